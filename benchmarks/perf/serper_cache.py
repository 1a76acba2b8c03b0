"""A run recorded through the Serper cache, then replayed from it: billed calls, cache hits, identical observations.

    python tests/search_r1/serper_standin.py --port 8950 --api-key KEY &     # or the real API: --serper-url default
    SERPER_API_KEY=KEY python -m benchmarks.perf.serper_cache --serper-url http://127.0.0.1:8950/search

Real Search-R1 trajectories are replayed turn by turn (the replay engine), so their searches are the real 3B model's
queries, through the real generate plugin with `--search-backend serper --serper-cache`. Pass 1 starts from an empty
cache (every distinct query is billed once); pass 2 runs the same trajectories with `--serper-replay-only` and no
API key. Prints, per pass, searches, billed calls, cache hits, hit rate and wall time, and whether every trajectory
of pass 2 saw exactly the observations of pass 1.

Its figures: `docs/benchmarks/serper_cache.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.paths import SHARED
from benchmarks.harness.queries import load_questions


async def run_pass(args_ns, questions: list[str], concurrency: int) -> tuple[dict, list[str]]:
    from slime_search.search_r1.generate import close_resources, generate
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.types import Sample

    slots = asyncio.Semaphore(concurrency)

    async def one(question: str):
        async with slots:
            sample = Sample(prompt=make_prompt(question))
            return await generate(args_ns, sample, {"temperature": 1.0, "max_new_tokens": 512})

    start = time.perf_counter()
    try:
        samples = await asyncio.gather(*(one(q) for q in questions))
    finally:
        await close_resources()
    searches = sum(s.metrics["searches"] for s in samples)
    billed = sum(s.metrics["search_billed"] for s in samples)
    hits = sum(s.metrics["search_cache_hits"] for s in samples)
    failed = sum(s.status.value == "failed" for s in samples)
    report = {
        "trajectories": len(samples),
        "searches": searches,
        "billed_calls": billed,
        "cache_hits": hits,
        "hit_rate": round(hits / max(1, billed + hits), 4),
        "failed": failed,
        "seconds": round(time.perf_counter() - start, 2),
    }
    return report, [s.response for s in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serper-url", required=True, help="Serper's endpoint (or a stand-in's)")
    parser.add_argument("--trajectories", default=str(SHARED / "trajectories" / "search_r1_3b_base_nq.jsonl"))
    parser.add_argument("--num-trajectories", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cache", default=None, help="the SQLite file (default: a new one in a temporary folder)")
    args = parser.parse_args(argv)
    if not Path(args.trajectories).is_file():
        print(f"no trajectories at {args.trajectories} (../shared/data is not beside this checkout)", file=sys.stderr)
        return 2
    if not os.environ.get("SERPER_API_KEY"):
        print("set SERPER_API_KEY (the stand-in's --api-key, or a real key)", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="bench-serper-") as tmp:  # the tokenizer and, unless --cache, the cache
        return measure(args, Path(tmp))


def measure(args, work: Path) -> int:
    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.search_r1.config import search_r1_args
    from slime_search.utils.server_process import ServerProcess

    tokenizer_path = str(save_tiny_checkpoint(work / "tiny"))
    cache = args.cache or str(work / "serper.sqlite")
    questions = load_questions(Path(args.trajectories), args.num_trajectories)
    engine_argv = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", tokenizer_path]
    with ServerProcess([*engine_argv, "--trajectories", args.trajectories, "--port", "0"]) as engine:
        common = dict(
            engine_url=engine.url,
            hf_checkpoint=tokenizer_path,
            apply_chat_template=True,
            search_backend="serper",
            serper_url=args.serper_url,
            serper_cache=cache,
            max_response_tokens=4096,
        )
        recorded, first = asyncio.run(run_pass(search_r1_args(**common), questions, args.concurrency))
        key = os.environ.pop("SERPER_API_KEY")  # replay-only needs none
        try:
            replay_args = search_r1_args(**common, serper_replay_only=True)
            replayed, second = asyncio.run(run_pass(replay_args, questions, args.concurrency))
        finally:
            os.environ["SERPER_API_KEY"] = key
    print(json.dumps({"pass": "record", **recorded}))
    print(json.dumps({"pass": "replay-only", **replayed}))
    print(
        json.dumps(
            {"identical_trajectories": sum(a == b for a, b in zip(first, second, strict=True)), "of": len(first)}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
