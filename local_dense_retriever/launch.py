"""Start a retrieval server as a child process on 127.0.0.1 and wait until it is healthy.

Used by the benchmark, the tests and the run scripts; it stops only the process it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVER_SCRIPT = Path(__file__).resolve().parent / "retrieval_server.py"


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the process that started it dies, so no orphan keeps the port."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class RetrievalServerProcess:
    """Start `retrieval_server.py` on a free 127.0.0.1 port; stop it (our own PID only) on exit."""

    def __init__(self, *args: str, timeout: float = 120.0):
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER_SCRIPT), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("serving on "):
            self.stop()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url = line.split()[-1]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("server never became healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
