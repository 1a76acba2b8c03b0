"""ServerProcess against small real servers on 127.0.0.1: a late wait still finds a server that is up, and a server
that never comes up fails in bounded time."""

import time

import httpx
import pytest

from slime_search.utils.server_process import ServerProcess

pytestmark = pytest.mark.timeout(120)

# Prints its address once bound, answers 200 on /health.
HEALTHY_SERVER = """
import http.server

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
print(f"serving on http://127.0.0.1:{server.server_address[1]}", flush=True)
server.serve_forever()
"""
SILENT_SERVER = "import time; time.sleep(600)"


def test_a_server_waited_for_after_its_start_timeout_is_found_up():
    server = ServerProcess(["-c", HEALTHY_SERVER], timeout=2, wait=False)
    try:
        time.sleep(3)  # the caller did other work for longer than the start timeout
        server.wait_ready()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_a_server_that_prints_no_address_fails_in_bounded_time():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="printed no address in time"):
        ServerProcess(["-c", SILENT_SERVER], timeout=2)
    assert time.monotonic() - started < 15

    late = ServerProcess(["-c", SILENT_SERVER], timeout=2, wait=False)
    time.sleep(3)
    waited_from = time.monotonic()
    with pytest.raises(RuntimeError, match="printed no address in time"):
        late.wait_ready()
    assert time.monotonic() - waited_from < 15  # a late wait gets a grace of at most the timeout, not a new start
    assert late.proc.poll() is not None  # and the failed server was stopped


# Prints its address, answers /health, and serves its own environment as JSON on /env.
ENV_SERVER = HEALTHY_SERVER.replace(
    "    def log_message",
    """    def do_POST(self):
        import json, os
        body = json.dumps(dict(os.environ)).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message""",
)


def test_a_server_gets_the_environment_given_without_the_variables_taken_out(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("KEPT_VARIABLE", "1")
    with ServerProcess(
        ["-c", ENV_SERVER], env={"ADDED": "2"}, unset_env=("PYTORCH_CUDA_ALLOC_CONF", "ABSENT_ANYWAY")
    ) as server:
        seen = httpx.post(f"{server.url}/env", timeout=5).json()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen and (seen["KEPT_VARIABLE"], seen["ADDED"]) == ("1", "2")
    with ServerProcess(["-c", ENV_SERVER]) as server:  # nothing taken out unless asked
        assert (
            httpx.post(f"{server.url}/env", timeout=5).json()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        )
