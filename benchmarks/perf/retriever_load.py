"""The retrieval server under mixed and hostile load: small requests alone and beside large ones, a flood of huge
bodies, and connections too slow to send a request. Launches the server (cache off) on a free 127.0.0.1 port.

    python -m benchmarks.perf.retriever_load --index-path IDX --corpus-path CORPUS.jsonl [--retriever-name bm25] \
        [--queries-from ../shared/data/trajectories] [--seconds 20] [--large-requests 8 --large-size 5000]

Prints one JSON line per scenario: p50/p99 of 1-query requests from --small-clients clients, alone and while
--large-requests requests of --large-size queries are in flight (with what those got back); the server's peak RSS
while --floods bodies of --flood-mb MB are sent at once; and how many of --slow-connections connections that never
finish their headers the server has closed after its header timeout, with small requests served meanwhile.

Its figures: `docs/benchmarks/retrieval.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.harness.paths import SHARED
from benchmarks.harness.queries import load_queries
from slime_search.metrics import percentile


def status_counts(statuses: list) -> dict[str, int]:
    """How many of each HTTP status (or client error name) came back."""
    names = [str(s) for s in statuses]
    return {name: names.count(name) for name in sorted(set(names))}


def latency_line(name: str, latencies: list[float], statuses: list, seconds: float) -> dict:
    ok = [lat for lat, status in zip(latencies, statuses, strict=True) if status == 200]
    line = {
        "scenario": name,
        "requests": len(statuses),
        "ok": len(ok),
        "statuses": status_counts(statuses),
        "queries_per_s": round(len(ok) / seconds, 1),
        "p50_ms": round(1000 * statistics.median(ok), 1) if ok else None,
        "p99_ms": round(1000 * percentile(ok, 0.99), 1) if ok else None,
    }
    print(json.dumps(line), flush=True)
    return line


async def small_clients(url: str, queries: list[str], clients: int, until) -> tuple[list[float], list]:
    """`clients` clients, each sending 1-query requests one after another while `until()` is false."""
    import aiohttp

    latencies: list[float] = []
    statuses: list = []
    rng = random.Random(0)

    async def client(session):
        while not until():
            body = {"queries": [rng.choice(queries)], "topk": 3}
            started = time.perf_counter()
            try:
                async with session.post(f"{url}/retrieve", json=body) as response:
                    await response.read()
                    statuses.append(response.status)
            except aiohttp.ClientError as err:
                statuses.append(type(err).__name__)
            latencies.append(time.perf_counter() - started)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return latencies, statuses


async def mixed(url: str, queries: list[str], args) -> list[dict]:
    """Small clients for --seconds alone, then again while the large requests are in flight."""
    import aiohttp

    lines = []
    began = time.perf_counter()
    latencies, statuses = await small_clients(
        url, queries, args.small_clients, lambda: time.perf_counter() - began > args.seconds
    )
    lines.append(latency_line(f"{args.small_clients} clients x 1 query, alone", latencies, statuses, args.seconds))
    if not args.large_requests:
        return lines

    large_done = asyncio.Event()
    large_results: list[tuple[float, object]] = []

    async def large(session, i: int):
        # real queries, each made unique (the server searches a repeated query once, and its cache is off)
        body = {"queries": [f"{queries[j % len(queries)]} {i} {j}" for j in range(args.large_size)], "topk": 3}
        started = time.perf_counter()
        try:
            async with session.post(f"{url}/retrieve", json=body) as response:
                await response.read()
                large_results.append((time.perf_counter() - started, response.status))
        except aiohttp.ClientError as err:
            large_results.append((time.perf_counter() - started, type(err).__name__))

    async def all_large():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await asyncio.gather(*(large(session, i) for i in range(args.large_requests)))
        large_done.set()

    began = time.perf_counter()
    large_task = asyncio.create_task(all_large())
    await asyncio.sleep(0.5)  # the large requests are read and queued first
    latencies, statuses = await small_clients(url, queries, args.small_clients, large_done.is_set)
    await large_task
    seconds = time.perf_counter() - began
    name = f"{args.small_clients} clients x 1 query, beside {args.large_requests} requests x {args.large_size} queries"
    lines.append(latency_line(name, latencies, statuses, seconds))
    large_statuses = [status for _, status in large_results]
    answered = sum(status == 200 for status in large_statuses)
    print(json.dumps({
        "large_requests": status_counts(large_statuses),
        "large_seconds_max": round(max(t for t, _ in large_results), 1),
        "large_queries_per_s": round(answered * args.large_size / seconds, 1),
    }), flush=True)  # fmt: skip
    return lines


def flood(url: str, args, rss_of) -> dict:
    """--floods bodies of --flood-mb MB at once (half with Content-Length, half streamed without): statuses and the
    server's peak RSS meanwhile."""
    import httpx

    chunk = b"x" * (1 << 20)
    statuses: list = []

    def send(declared: bool):
        def body():
            for _ in range(args.flood_mb):
                yield chunk

        headers = {"Content-Length": str(args.flood_mb << 20)} if declared else {}
        try:
            response = httpx.post(f"{url}/retrieve", content=body(), headers=headers, timeout=120)
            statuses.append(response.status_code)
        except httpx.HTTPError as err:  # the server may close the connection after its 413
            statuses.append(type(err).__name__)

    before = rss_of()
    threads = [threading.Thread(target=send, args=(i % 2 == 0,)) for i in range(args.floods)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_of())
        time.sleep(0.05)
    line = {
        "scenario": f"{args.floods} bodies of {args.flood_mb} MB at once",
        "statuses": status_counts(statuses),
        "seconds": round(time.perf_counter() - started, 2),
        "server_rss_mb_before": before,
        "server_rss_mb_peak": peak,
    }
    print(json.dumps(line), flush=True)
    return line


def slowloris(url: str, queries: list[str], args, header_timeout: float) -> dict:
    """--slow-connections connections that send half a request's headers and stop; small requests meanwhile."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(args.slow_connections):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        sock.setblocking(False)
        sockets.append(sock)
    began = time.perf_counter()
    latencies, statuses = asyncio.run(
        small_clients(url, queries, args.small_clients, lambda: time.perf_counter() - began > header_timeout + 3)
    )
    closed = 0
    for sock in sockets:
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass  # still open
        except ConnectionResetError:
            closed += 1
        sock.close()
    line = latency_line(
        f"{args.small_clients} clients x 1 query, beside {args.slow_connections} slowloris connections",
        latencies, statuses, time.perf_counter() - began,
    )  # fmt: skip
    line = {"slow_connections": args.slow_connections, "closed_after_s": header_timeout + 3, "closed": closed}
    print(json.dumps(line), flush=True)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-path", required=True)
    parser.add_argument("--corpus-path", required=True)
    parser.add_argument("--retriever-name", default="dense")
    parser.add_argument("--retriever-model", default=None)
    default_queries = SHARED / "trajectories"
    parser.add_argument("--queries-from", default=str(default_queries))
    parser.add_argument("--num-queries", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the small clients run alone")
    parser.add_argument("--small-clients", type=int, default=32)
    parser.add_argument("--large-requests", type=int, default=8)
    parser.add_argument("--large-size", type=int, default=5000)
    parser.add_argument("--floods", type=int, default=4)
    parser.add_argument("--flood-mb", type=int, default=100)
    parser.add_argument("--slow-connections", type=int, default=256)
    parser.add_argument("--header-timeout", type=float, default=10.0)
    parser.add_argument("--server-arg", action="append", default=[], help="an extra flag for the server (repeat)")
    args = parser.parse_args(argv)
    queries = load_queries(Path(args.queries_from), args.num_queries)
    import psutil

    from local_dense_retriever.launch import RetrievalServerProcess

    server_args = ["--index-path", args.index_path, "--corpus-path", args.corpus_path, "--cache-size", "0"]
    server_args += ["--retriever-name", args.retriever_name]
    if args.slow_connections:  # (a server from before the read deadlines takes no such flag)
        server_args += ["--header-timeout", str(args.header_timeout)]
    if args.retriever_model:
        server_args += ["--retriever-model", args.retriever_model]
    with RetrievalServerProcess(*server_args, *args.server_arg) as server:
        process = psutil.Process(server.proc.pid)

        def rss_mb() -> int:
            return process.memory_info().rss >> 20

        asyncio.run(mixed(server.url, queries, args))
        if args.floods:
            flood(server.url, args, rss_mb)
        if args.slow_connections:
            slowloris(server.url, queries, args, args.header_timeout)
        print(json.dumps({"server_alive_at_end": server.proc.poll() is None, "server_rss_mb_end": rss_mb()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
