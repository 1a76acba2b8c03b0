"""Load benchmark of the retrieval server with real Search-R1 queries, alone or beside Search-R1's own server.

    python -m benchmarks.perf.retriever_throughput --index-path IDX/minilm_Flat.index --corpus-path CORPUS.jsonl \
        --queries-from ../shared/data/trajectories --num-queries 1000 --topk 3
    python -m benchmarks.perf.retriever_throughput --index-path IDX/minilm_Flat.index --corpus-path CORPUS.jsonl \
        --search-r1-server SEARCH_R1/search_r1/search/retrieval_server.py --rounds 3

Launches the server (cache off, so repeated scenarios measure search, not the cache) on a free 127.0.0.1 port,
or targets a running one with --url. Scenarios: 1 client, N concurrent single-query clients, batched requests,
and a robustness run of many requests at high concurrency with malformed ones mixed in. Prints queries/s,
p50/p99 latency and errors per scenario, and how many top-k lists equal an exact in-process search.

With --search-r1-server (the file from a Search-R1 checkout), both servers are up at once on the same index and corpus.
Each round drives one, then the other, and the order alternates. Both get the same 1-client and N-client scenarios and
the same queries. Their server runs as its __main__ sets it up: the model and batches moved to CUDA, which on a machine
without one is left on CPU. It runs on the same kind of 127.0.0.1 socket as ours, with its request log at warning level
like ours. Prints each round's figures per server, the ratios, and whether the top-1 of each query under N-client load
is the same on both. A different one counts as a floating-point near-tie when the exact in-process search scores the two
within NEAR_TIE of each other.

Its figures: `docs/benchmarks/retrieval.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import REPO, SHARED
from benchmarks.harness.queries import load_queries
from slime_search.metrics import percentile

NEAR_TIE = 1e-4  # two cosine scores this close may swap places between two float32 encoders

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


def report(name: str, run: dict, n_queries: int, server: str | None = None) -> dict:
    ok = sum(1 for s in run["statuses"] if s == 200)
    line = {
        **({"server": server} if server else {}),
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


def exact_hits(args, queries: list[str], topk: int) -> list[list[tuple[str, float]]]:
    """The same index and encoder searched in this process, one batch: the reference answer, (id, score) per hit."""
    from local_dense_retriever.corpus import Corpus
    from local_dense_retriever.index import DenseRetriever, encoder_config_from_meta, read_meta

    path = Path(args.index_path)
    retriever = DenseRetriever(path, encoder_config_from_meta(read_meta(path), model_path=args.retriever_model))
    corpus = Corpus(args.corpus_path)
    rows, scores = retriever.search(queries, topk)
    return [
        [(corpus[int(r)]["id"], float(s)) for r, s in zip(row, score, strict=True) if r >= 0]
        for row, score in zip(rows, scores, strict=True)
    ]


def exact_top_ids(args, queries: list[str], topk: int) -> list[list[str]]:
    return [[doc_id for doc_id, _ in hits] for hits in exact_hits(args, queries, topk)]


def ids_of(result) -> list[str]:
    return [doc["id"] for doc in result]


async def scenarios(args, url: str, queries: list[str]) -> list[dict]:
    lines = []
    single = [{"queries": [q], "topk": args.topk} for q in queries]
    run = await run_requests(url, single[: args.single_client_queries], 1)
    lines.append(report("1 client, 1 query/request", run, args.single_client_queries))
    run = await run_requests(url, single * args.load_passes, args.concurrency)
    lines.append(report(f"{args.concurrency} clients, 1 query/request", run, len(queries) * args.load_passes))
    concurrent_results = run["results"][: len(queries)]
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


def top1_agreement(exact: list, ours: list, theirs: list) -> dict:
    """How many queries got the same top-1 from both servers; a different one is a near-tie when the exact search
    scores the two documents within NEAR_TIE of each other, a real difference otherwise."""
    counts = {"same": 0, "near_ties": 0, "different": 0, "unanswered": 0}
    for reference, a, b in zip(exact, ours, theirs, strict=True):  # a, b: a one-query request's result
        if not a or not a[0] or not b or not b[0]:
            counts["unanswered"] += 1
            continue
        first_a, first_b = a[0][0]["document"]["id"], b[0][0]["document"]["id"]
        scores = dict(reference)
        if first_a == first_b:
            counts["same"] += 1
        elif first_a in scores and first_b in scores and abs(scores[first_a] - scores[first_b]) <= NEAR_TIE:
            counts["near_ties"] += 1
        else:
            counts["different"] += 1
    return counts


async def one_round(url: str, single: list[dict], args, server: str) -> tuple[dict, dict, list]:
    """The two compared scenarios on one server: its 1-client line, its N-client line and the N-client answers."""
    run = await run_requests(url, single[: args.single_client_queries], 1)
    alone = report("1 client, 1 query/request", run, args.single_client_queries, server)
    run = await run_requests(url, single * args.load_passes, args.concurrency)
    loaded = report(f"{args.concurrency} clients, 1 query/request", run, len(single) * args.load_passes, server)
    return alone, loaded, run["results"][: len(single)]


def side_by_side(args, queries: list[str], ours_args: list[str]) -> int:
    """Both servers up at once; each round drives one and then the other with the same requests."""
    from local_dense_retriever.index import encoder_config_from_meta, read_meta
    from local_dense_retriever.launch import RetrievalServerProcess
    from slime_search.utils.server_process import ServerProcess

    model = args.retriever_model or encoder_config_from_meta(read_meta(Path(args.index_path))).model_path
    theirs_argv = ["-m", "benchmarks.perf.retriever_throughput", "--serve-search-r1", args.search_r1_server]
    theirs_argv += ["--index-path", args.index_path, "--corpus-path", args.corpus_path, "--retriever-model", model]
    root = str(REPO)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # with scores, as Search-R1's rollouts ask (its server answers nothing else: without them its handler fails)
    single = [{"queries": [q], "topk": args.topk, "return_scores": True} for q in queries]
    with (
        RetrievalServerProcess(*ours_args) as ours,
        ServerProcess(theirs_argv, health_path="/docs", timeout=600, env=env) as theirs,
    ):
        servers = {"ours": ours.url, "search-r1": theirs.url}
        answers: dict[str, list] = {}
        for number in range(args.rounds):
            order = list(servers) if number % 2 == 0 else list(reversed(servers))
            lines = {}
            for name in order:
                alone, loaded, results = asyncio.run(one_round(servers[name], single, args, name))
                lines[name] = (alone, loaded)
                answers.setdefault(name, results)  # the first round's answers are compared below
            (ours_alone, ours_loaded), (their_alone, their_loaded) = lines["ours"], lines["search-r1"]
            print(json.dumps({
                "round": number + 1,
                "order": order,
                f"{args.concurrency}_clients_qps_ratio": round(ours_loaded["queries_per_s"] / their_loaded["queries_per_s"], 2),
                f"ours_{args.concurrency}_clients_p99_ms": ours_loaded["p99_ms"],
                "1_client_p50_ratio": round(their_alone["p50_ms"] / ours_alone["p50_ms"], 2),
                "1_client_qps_ratio": round(ours_alone["queries_per_s"] / their_alone["queries_per_s"], 2),
            }), flush=True)  # fmt: skip
        exact = exact_hits(args, queries, args.topk)
        counts = top1_agreement(exact, answers["ours"], answers["search-r1"])
        print(json.dumps({"check": f"top-1 under {args.concurrency}-client load, ours vs search-r1", **counts}))
        same = sum(
            1
            for r, e in zip(answers["ours"], exact, strict=True)
            if r and [hit["document"]["id"] for hit in r[0]] == [i for i, _ in e]
        )
        print(json.dumps({"check": f"ours: top-{args.topk} identical to exact in-process search", "same": same}))
        print(json.dumps({"servers_alive_at_end": [ours.proc.poll() is None, theirs.proc.poll() is None]}))
    return 0


def serve_search_r1(args) -> int:
    """Search-R1's retrieval_server.py as its __main__ sets it up (dense, mean pooling, max length 256, batches of
    512, fp16 on GPU only), on a free 127.0.0.1 port announced as our servers announce theirs."""
    import importlib.util

    import torch
    import uvicorn

    from slime_search.utils.net import listen_socket

    if not torch.cuda.is_available():  # their encoder calls .cuda() on the model and every batch
        torch.nn.Module.cuda = lambda self, device=None: self
        torch.Tensor.cuda = lambda self, *a, **k: self
    spec = importlib.util.spec_from_file_location("search_r1_retrieval_server", args.serve_search_r1)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.config = module.Config(
        retrieval_method=args.retriever_name,
        index_path=args.index_path,
        corpus_path=args.corpus_path,
        retrieval_topk=args.topk,
        faiss_gpu=False,
        retrieval_model_path=args.retriever_model,
        retrieval_pooling_method="mean",
        retrieval_query_max_length=256,
        retrieval_use_fp16=torch.cuda.is_available(),
        retrieval_batch_size=512,
    )
    module.retriever = module.get_retriever(module.config)
    sock = listen_socket("127.0.0.1", 0)
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(uvicorn.Config(module.app, log_level="warning")).serve(sockets=[sock]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; otherwise one is launched from the index flags")
    parser.add_argument("--index-path")
    parser.add_argument("--corpus-path")
    parser.add_argument("--retriever-name", default="dense")
    parser.add_argument("--retriever-model", default=None)
    parser.add_argument("--queries-from", default=str(SHARED / "trajectories"))
    parser.add_argument("--num-queries", type=int, default=1000)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--single-client-queries", type=int, default=200)
    parser.add_argument(
        "--load-passes",
        type=int,
        default=1,
        help="times the N-client scenario sends each query: at 256 clients one pass of 1,000 is four waves of "
        "requests, the first opening every connection, so a fast server's figure is mostly that start",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--robust-requests", type=int, default=10_000)
    parser.add_argument("--robust-concurrency", type=int, default=512)
    parser.add_argument("--search-r1-server", help="Search-R1's search_r1/search/retrieval_server.py: run beside it")
    parser.add_argument("--rounds", type=int, default=3, help="side-by-side rounds (with --search-r1-server)")
    parser.add_argument("--encoder-runtime", default=None, help="our server's --encoder-runtime (default: its own)")
    parser.add_argument("--encoder-threads", type=int, default=None, help="our server's --encoder-threads")
    parser.add_argument("--serve-search-r1", help=argparse.SUPPRESS)  # the child that serves theirs
    args = parser.parse_args(argv)
    if args.serve_search_r1:
        return serve_search_r1(args)
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
    if args.encoder_runtime:
        server_args += ["--encoder-runtime", args.encoder_runtime]
    if args.encoder_threads is not None:
        server_args += ["--encoder-threads", str(args.encoder_threads)]
    if args.search_r1_server:
        return side_by_side(args, queries, server_args)
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
