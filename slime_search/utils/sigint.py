"""SIGINT for a driver however it was launched."""

from __future__ import annotations


def answer_sigint() -> None:
    """Stop on SIGINT however the driver was launched: a job started in the background by a non-interactive shell
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
