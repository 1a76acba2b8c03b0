"""Start a retrieval server as a child process on 127.0.0.1 and wait until it is healthy.

Used by the benchmark, the tests and the run scripts; it stops only the process it started.
"""

from __future__ import annotations

from pathlib import Path

from slime_search.utils.server_process import ServerProcess

SERVER_SCRIPT = Path(__file__).resolve().parent / "retrieval_server.py"


class RetrievalServerProcess(ServerProcess):
    """`retrieval_server.py` with the given flags, on a free 127.0.0.1 port."""

    def __init__(self, *args: str, timeout: float = 120.0):
        super().__init__([str(SERVER_SCRIPT), "--port", "0", *args], health_path="/health", timeout=timeout)
