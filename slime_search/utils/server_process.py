"""Run one of the project's HTTP servers as a child process on 127.0.0.1 and wait until it is healthy.

The server prints "serving on http://HOST:PORT" once its socket is bound (port 0 picks a free one). Output goes
to a log file, never to an unread pipe that could fill and stall the server. Only the started process is ever
stopped, and on Linux it also receives SIGTERM if the parent dies, so no orphan keeps a port.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

READY_PREFIX = "serving on "
LATE_WAIT_GRACE_S = 10.0  # how long wait_ready() still waits when called after the start's deadline (at most timeout)


def _die_with_parent() -> None:
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_environment(
    base: dict[str, str], env: dict[str, str] | None = None, unset: tuple[str, ...] = ()
) -> dict[str, str]:
    """A server's environment: `base` (this process's) with `env` added and the variables of `unset` removed."""
    merged = {**base, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return {name: value for name, value in merged.items() if name not in unset}


class ServerProcess:
    def __init__(
        self,
        argv: list[str],
        health_path: str = "/health",
        timeout: float = 120.0,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        url: str | None = None,
        python: str | None = None,
        wait: bool = True,
        unset_env: tuple[str, ...] = (),
    ):
        """`url`: where the server will listen, for programs that do not print READY_PREFIX (SGLang). `python`: the
        interpreter to run `argv` with (this one by default). `wait=False` only starts the process: start several,
        then `wait_ready()` on each, and they come up together rather than one after another. `env` is added to this
        process's environment and `unset_env` taken out of it."""
        # A log file of our own making is removed at stop: a failed start has already quoted its tail.
        self._owns_log = log_path is None
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="server-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        self.health_path = health_path
        self.url = url
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the child writes to it for its whole life
        self.proc = subprocess.Popen(
            [python or sys.executable, *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_environment(dict(os.environ), env, unset_env),
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the address and a healthy answer, until the start's deadline or, when called later than that, for
        a short grace; at least one look at the log and one probe are made either way. Stop the server on failure."""
        # A server started with wait=False may be waited for long after its deadline (the driver trains the actor
        # while a restarted engine comes up): it has had its whole timeout to start by then, so it is judged on what
        # it answers now, not on the clock alone. Keeping the spawn deadline otherwise lets several servers started
        # together share one bound instead of each getting a fresh timeout in turn.
        deadline = max(self._deadline, time.monotonic() + min(LATE_WAIT_GRACE_S, self._timeout))
        try:
            if self.url is None:
                self.url = self._wait_for_address(deadline)
            self._wait_until_healthy(deadline)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_for_address(self, deadline: float) -> str:
        while True:  # the log is read at least once, however late
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    return line[len(READY_PREFIX) :].strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"server printed no address in time: {self.log_tail()}")
            time.sleep(0.05)

    def _wait_until_healthy(self, deadline: float) -> None:
        while True:  # probed at least once, however late
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"server at {self.url} never became healthy: {self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self._owns_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
