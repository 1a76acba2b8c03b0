"""Drive many concurrent Search-R1 trajectories through an engine and a real retriever; print throughput.

    # the CPU engine with a tiny random Qwen2 (measures the engine and the loop; a random policy rarely searches)
    python -m benchmarks.perf.rollout_concurrency --engine cpu --concurrency 256
    # real Search-R1 turns replayed (searches follow the real 3B model; the retriever and client do real work)
    python -m benchmarks.perf.rollout_concurrency --engine replay --concurrency 256

The retriever is BM25 over ../shared/data/corpus/wiki18_subset.jsonl unless --index-path names a dense index.
Prints trajectories/s, searches and turns per trajectory, and the search client's batching factor.

Its figures: `docs/benchmarks/rollout.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.paths import SHARED
from benchmarks.harness.queries import load_questions


async def drive(args_ns, questions: list[str], concurrency: int, max_new_tokens: int) -> dict:
    from slime_search.search_r1.generate import close_resources, generate, session_for
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.types import Sample

    slots = asyncio.Semaphore(concurrency)

    async def one(question: str):
        async with slots:
            sample = Sample(prompt=make_prompt(question))
            return await generate(args_ns, sample, {"temperature": 1.0, "max_new_tokens": max_new_tokens})

    start = time.perf_counter()
    try:
        samples = await asyncio.gather(*(one(q) for q in questions))
        elapsed = time.perf_counter() - start
        client = session_for(args_ns).resources.search
        batching = {
            "requests": client.requests_sent,
            "queries": client.queries_sent,
            "factor": round(client.batching_factor, 2),
        }
    finally:
        await close_resources()
    n = len(samples)
    return {
        "trajectories": n,
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "trajectories_per_s": round(n / elapsed, 2),
        "searches_per_trajectory": round(sum(s.metrics["searches"] for s in samples) / n, 3),
        "turns_per_trajectory": round(sum(s.metrics["turns"] for s in samples) / n, 3),
        "response_tokens_mean": round(sum(s.response_length for s in samples) / n, 1),
        "search_client_batching": batching,
        "finish_reasons": dict(collections.Counter(s.metadata["finish_reason"] for s in samples)),
        "statuses": dict(collections.Counter(s.status.value for s in samples)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["cpu", "replay"], default="cpu")
    parser.add_argument("--model-path", help="HF checkpoint for the CPU engine (default: a tiny random Qwen2)")
    parser.add_argument("--trajectories", default=str(SHARED / "trajectories" / "search_r1_3b_base_nq.jsonl"))
    parser.add_argument("--corpus-path", default=str(SHARED / "corpus" / "wiki18_subset.jsonl"))
    parser.add_argument("--index-path", help="dense faiss index (default: BM25 built over the corpus)")
    parser.add_argument("--num-trajectories", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-response-tokens", type=int, default=512)
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args(argv)

    from local_dense_retriever import build_index
    from local_dense_retriever.launch import RetrievalServerProcess
    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.search_r1.config import search_r1_args
    from slime_search.utils.server_process import ServerProcess

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        work = Path(tmp)
        model_path = args.model_path or str(save_tiny_checkpoint(work / "tiny"))
        if args.index_path:
            retriever_args = ["--index-path", args.index_path, "--corpus-path", args.corpus_path]
        else:
            build_index.main(["--retriever-name", "bm25", "--corpus-path", args.corpus_path, "--save-dir", str(work)])
            retriever_args = [
                "--retriever-name",
                "bm25",
                "--index-path",
                str(work / "bm25"),
                "--corpus-path",
                args.corpus_path,
            ]
        if args.engine == "cpu":
            engine_argv = [
                "-m",
                "slime_search.engines.cpu_engine_server",
                "--model-path",
                model_path,
                "--max-batch-size",
                "64",
            ]
        else:
            engine_argv = [
                "-m",
                "benchmarks.harness.stand_in_engines.replay",
                "--tokenizer",
                model_path,
                "--trajectories",
                args.trajectories,
            ]
        questions = load_questions(Path(args.trajectories), args.num_trajectories)
        with (
            RetrievalServerProcess(*retriever_args) as retriever,
            ServerProcess([*engine_argv, "--port", "0"]) as engine,
        ):
            ns = search_r1_args(
                engine_url=engine.url,
                hf_checkpoint=model_path,
                search_url=f"{retriever.url}/retrieve",
                apply_chat_template=True,
                max_turns=args.max_turns,
                max_response_tokens=args.max_response_tokens,
            )
            report = asyncio.run(drive(ns, questions, args.concurrency, args.max_new_tokens))
    report["engine"] = args.engine
    report["retriever"] = "dense" if args.index_path else "bm25"
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
