"""The real retrieval server (BM25, 127.0.0.1) against clients too big, too slow or too many: 413, closed
connections, 503 with Retry-After, and the ordinary requests beside them still answered."""

import json
import socket
import threading
import time

import httpx
import pytest

from local_dense_retriever import build_index
from tests.retriever_helpers import ServerProcess, write_tiny_corpus

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    write_tiny_corpus(root / "corpus.jsonl")
    args = ["--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root / "idx"), "--retriever-name", "bm25"]
    assert build_index.main(args) == 0
    with ServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "idx" / "bm25"), "--corpus-path",
        str(root / "corpus.jsonl"), "--max-body-bytes", "4000", "--header-timeout", "1", "--body-timeout", "1",
        "--max-pending-queries", "64", "--max-batch-size", "16", "--cache-size", "0", "--max-queries", "100000",
    ) as process:  # fmt: skip
        yield process


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (recv gives b""), or None if it stayed open that long."""
    sock.settimeout(seconds)
    start = time.monotonic()
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return time.monotonic() - start
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - start


def test_a_body_over_the_limit_gets_413_declared_or_streamed(server):
    small = httpx.post(f"{server.url}/retrieve", json={"queries": ["red falcon"], "topk": 1}, timeout=30)
    assert small.status_code == 200
    big = {"queries": ["red falcon " * 40] * 10}  # ~4,5 kB
    declared = httpx.post(f"{server.url}/retrieve", json=big, timeout=30)
    assert declared.status_code == 413 and "exceeds the limit of 4000" in declared.json()["detail"]

    def chunks():  # no Content-Length: the limit is found while the body streams in
        raw = json.dumps(big).encode()
        for i in range(0, len(raw), 500):
            yield raw[i : i + 500]

    streamed = httpx.post(f"{server.url}/retrieve", content=chunks(), timeout=30)
    assert streamed.status_code == 413 and "--max-body-bytes" in streamed.json()["detail"]
    assert httpx.get(f"{server.url}/health", timeout=30).json()["requests_too_large"] >= 2


def test_connections_too_slow_to_send_a_request_are_closed_and_others_served(server):
    idle = socket.create_connection(address(server))  # sends nothing at all
    slow_headers = socket.create_connection(address(server))
    slow_headers.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    slow_body = socket.create_connection(address(server))
    slow_body.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    slow_body.sendall(b"Content-Length: 100\r\n\r\n" + b'{"queries": [')  # 13 of 100 bytes
    answered = httpx.post(f"{server.url}/retrieve", json={"queries": ["blue otter"], "topk": 1}, timeout=30)
    assert answered.status_code == 200  # served while the slow ones hold their connections
    for sock in (idle, slow_headers, slow_body):
        seconds = closed_within(sock, 10)
        assert seconds is not None and seconds < 5, "a slow connection was left open"
        sock.close()
    with socket.create_connection(address(server)) as keep_alive:  # a normal request is not cut
        body = json.dumps({"queries": ["green lynx"], "topk": 1}).encode()
        request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        keep_alive.sendall(request % len(body) + body)
        keep_alive.settimeout(10)
        assert keep_alive.recv(4096).startswith(b"HTTP/1.1 200")


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounded")
    write_tiny_corpus(root / "corpus.jsonl")
    args = ["--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root / "idx"), "--retriever-name", "bm25"]
    assert build_index.main(args) == 0
    with ServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "idx" / "bm25"), "--corpus-path",
        str(root / "corpus.jsonl"), "--max-pending-queries", "64", "--max-batch-size", "16", "--cache-size", "0",
        "--max-queries", "100000",
    ) as process:  # fmt: skip
        yield process


def test_beyond_the_pending_bound_a_request_gets_503_with_retry_after_and_the_large_one_completes(bounded_server):
    url = bounded_server.url
    big = {"queries": [f"red falcon {i}" for i in range(40_000)], "topk": 1}  # unique: searched in slices of 16
    outcome = {}
    sender = threading.Thread(target=lambda: outcome.update(big=httpx.post(f"{url}/retrieve", json=big, timeout=240)))
    sender.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=30).json()["pending_queries"] == 0:
        assert time.monotonic() < deadline, "the large request never showed as pending"
    refused = httpx.post(f"{url}/retrieve", json={"queries": ["blue otter"], "topk": 1}, timeout=30)
    sender.join()
    assert refused.status_code == 503, refused.text
    assert "--max-pending-queries 64" in refused.json()["detail"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert outcome["big"].status_code == 200 and len(outcome["big"].json()["result"]) == 40_000
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["requests_overloaded"] == 1 and health["pending_queries"] == 0
    again = httpx.post(f"{url}/retrieve", json={"queries": ["blue otter"], "topk": 1}, timeout=30)
    assert again.status_code == 200  # nothing waiting: served
