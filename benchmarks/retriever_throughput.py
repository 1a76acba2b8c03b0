"""Load benchmark of the retrieval server with real Search-R1 queries.

    python -m benchmarks.retriever_throughput --index-path IDX/minilm_Flat.index --corpus-path CORPUS.jsonl \
        --queries-from ../shared/data/trajectories --num-queries 1000 --topk 3

Launches the server (cache off, so repeated scenarios measure search, not the cache) on a free 127.0.0.1 port,
or targets a running one with --url. Scenarios: 1 client, N concurrent single-query clients, batched requests,
and a robustness run of many requests at high concurrency with malformed ones mixed in. Prints queries/s,
p50/p99 latency and errors per scenario, and how many top-k lists equal an exact in-process search.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

from slime_search.metrics import percentile

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
# Refused with a 4xx: not the API's shape, or not JSON the parser takes (nesting deeper than it recurses, an
# integer past Python's 4,300-digit limit).
MALFORMED: list[dict | bytes] = [
    {"queries": []},
    {"queries": [1, 2]},
    {"queries": ["q"], "topk": -1},
    {"topk": 3},
    b"{not json",
    b"[" * 100_000,
    b'{"queries": ["q"], "topk": 1' + b"0" * 5000 + b"}",
]
# Odd but well-formed: answered 200, query by query (a blank query gets no documents, a long one is cut, a lone
# surrogate replaced).
ODD: list[dict | bytes] = [
    {"queries": [""]},
    {"queries": ["   ", "who wrote hamlet"]},
    {"queries": ["x" * 10_000]},
    b'{"queries": ["red \\ud800 otter", "who wrote hamlet"]}',
]


def load_queries(folder: Path, limit: int) -> list[str]:
    """Unique <search> queries issued by the real Search-R1 model, in file order."""
    seen: dict[str, None] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.open():
            for query in _SEARCH.findall(json.loads(line)["response"]):
                query = " ".join(query.split())
                if query and len(query) < 500:
                    seen.setdefault(query, None)
    queries = list(seen)[:limit]
    if len(queries) < limit:
        print(f"note: only {len(queries)} unique queries found", file=sys.stderr)
    return queries


async def run_requests(url: str, bodies: list, concurrency: int) -> dict:
    import aiohttp

    latencies, statuses, results = [], [None] * len(bodies), [None] * len(bodies)
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i, body):
            async with semaphore:
                start = time.perf_counter()
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                headers = {"Content-Type": "application/json"}
                try:
                    async with session.post(f"{url}/retrieve", data=raw, headers=headers) as response:
                        statuses[i] = response.status
                        if response.status == 200:
                            results[i] = (await response.json())["result"]
                        else:
                            await response.read()
                except aiohttp.ClientError as err:
                    statuses[i] = type(err).__name__
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "latencies": latencies, "statuses": statuses, "results": results}


def report(name: str, run: dict, n_queries: int) -> dict:
    ok = sum(1 for s in run["statuses"] if s == 200)
    line = {
        "scenario": name,
        "requests": len(run["statuses"]),
        "queries_per_s": round(n_queries / run["elapsed"], 1),
        "p50_ms": round(1000 * statistics.median(run["latencies"]), 1),
        "p99_ms": round(1000 * percentile(run["latencies"], 0.99), 1),
        "ok": ok,
        "errors": len(run["statuses"]) - ok,
    }
    print(json.dumps(line), flush=True)
    return line


def exact_top_ids(args, queries: list[str], topk: int) -> list[list[str]]:
    """The same index and encoder searched in this process, one batch: the reference answer."""
    from local_dense_retriever.corpus import Corpus
    from local_dense_retriever.index import DenseRetriever, encoder_config_from_meta, read_meta

    path = Path(args.index_path)
    retriever = DenseRetriever(path, encoder_config_from_meta(read_meta(path), model_path=args.retriever_model))
    corpus = Corpus(args.corpus_path)
    rows, _ = retriever.search(queries, topk)
    return [[corpus[int(r)]["id"] for r in row if r >= 0] for row in rows]


def ids_of(result) -> list[str]:
    return [doc["id"] for doc in result]


async def scenarios(args, url: str, queries: list[str]) -> list[dict]:
    lines = []
    single = [{"queries": [q], "topk": args.topk} for q in queries]
    run = await run_requests(url, single[: args.single_client_queries], 1)
    lines.append(report("1 client, 1 query/request", run, args.single_client_queries))
    run = await run_requests(url, single, args.concurrency)
    lines.append(report(f"{args.concurrency} clients, 1 query/request", run, len(queries)))
    concurrent_results = run["results"]
    batched = [{"queries": queries[i : i + args.batch], "topk": args.topk} for i in range(0, len(queries), args.batch)]
    run = await run_requests(url, batched, 4)
    lines.append(report(f"4 clients, {args.batch} queries/request", run, len(queries)))
    if args.index_path and "bm25" not in str(args.index_path):
        exact = exact_top_ids(args, queries, args.topk)
        same = sum(1 for r, e in zip(concurrent_results, exact, strict=True) if r is not None and ids_of(r[0]) == e)
        print(
            json.dumps(
                {"check": f"top-{args.topk} identical to exact in-process search", "same": same, "of": len(queries)}
            )
        )
    lines.append(await robustness(args, url, single))
    return lines


async def robustness(args, url: str, single: list[dict]) -> dict:
    """Many requests at high concurrency, 20% malformed and 5% odd but well-formed: every valid one (odd ones
    included) must get 200, every malformed one 4xx, none a 5xx or a dropped connection."""
    rng = random.Random(0)
    kinds = [rng.choices(["malformed", "odd", "valid"], [0.2, 0.05, 0.75])[0] for _ in range(args.robust_requests)]
    pools = {"malformed": MALFORMED, "odd": ODD, "valid": single}
    mixed = [rng.choice(pools[kind]) for kind in kinds]
    run = await run_requests(url, mixed, args.robust_concurrency)
    valid = [s for s, kind in zip(run["statuses"], kinds, strict=True) if kind != "malformed"]
    malformed = [s for s, kind in zip(run["statuses"], kinds, strict=True) if kind == "malformed"]
    line = report(f"{args.robust_requests} requests at {args.robust_concurrency}, 20% malformed", run, len(mixed))
    counts = {
        "valid_200": sum(s == 200 for s in valid),
        "valid": len(valid),
        "malformed_4xx": sum(isinstance(s, int) and 400 <= s < 500 for s in malformed),
        "malformed": len(malformed),
        "5xx": sum(isinstance(s, int) and s >= 500 for s in run["statuses"]),
        "connection_errors": sum(isinstance(s, str) for s in run["statuses"]),
    }
    print(json.dumps({"robustness": counts}), flush=True)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; otherwise one is launched from the index flags")
    parser.add_argument("--index-path")
    parser.add_argument("--corpus-path")
    parser.add_argument("--retriever-name", default="dense")
    parser.add_argument("--retriever-model", default=None)
    parser.add_argument("--queries-from", default=str(Path(__file__).resolve().parents[2] / "shared/data/trajectories"))
    parser.add_argument("--num-queries", type=int, default=1000)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--single-client-queries", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--robust-requests", type=int, default=10_000)
    parser.add_argument("--robust-concurrency", type=int, default=512)
    args = parser.parse_args(argv)
    queries = load_queries(Path(args.queries_from), args.num_queries)
    if args.url:
        asyncio.run(scenarios(args, args.url, queries))
        return 0
    import psutil

    from local_dense_retriever.launch import RetrievalServerProcess

    server_args = ["--index-path", args.index_path, "--corpus-path", args.corpus_path, "--cache-size", "0"]
    server_args += ["--retriever-name", args.retriever_name]
    if args.retriever_model:
        server_args += ["--retriever-model", args.retriever_model]
    with RetrievalServerProcess(*server_args) as server:
        process = psutil.Process(server.proc.pid)
        rss = [process.memory_info().rss >> 20]
        asyncio.run(scenarios(args, server.url, queries))
        rss.append(process.memory_info().rss >> 20)
        # A second robustness round: bounded memory means it does not keep growing with the request count.
        asyncio.run(robustness(args, server.url, [{"queries": [q], "topk": args.topk} for q in queries]))
        rss.append(process.memory_info().rss >> 20)
        print(
            json.dumps({"server_rss_mb": {"start": rss[0], "after_scenarios": rss[1], "after_2nd_robustness": rss[2]}})
        )
        print(json.dumps({"server_alive_at_end": server.proc.poll() is None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
