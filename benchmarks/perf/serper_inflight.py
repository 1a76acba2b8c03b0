"""Identical Serper queries in flight sent once: billed calls per training step with and without sharing, on the
queries of real Search-R1 trajectories grouped as GRPO samples them.

    python -m benchmarks.perf.serper_inflight                                   # 4 steps of 64 prompts x 5 samples
    python -m benchmarks.perf.serper_inflight --steps 1 --prompts-per-step 4    # the smoke test's size

Each prompt's n samples replay its recorded trajectory; `../shared/data/trajectories` holds one, greedy, per question. A
sample asks the recorded query of each turn with probability --agreement. From the first turn it does not, it asks
queries of its own (1: the whole group agrees; recorded data cannot tell how often sampled groups do, so the figure is
given for several values). Before each search a sample "generates" its turn: the turn's characters / 4 tokens at
--ms-per-token, scaled per sample by a uniform jitter of +-`--jitter`, so a group's samples drift apart turn by turn.
Searches go through the real SerperClient (one per step, as a rollout has one) to the Serper stand-in of the tests,
answering --latency-ms late. Each step runs twice, with identical queries in flight shared and not; both bill a query
only once it is in the client's memory cache. Prints one JSON line per step and one for the run, with how often the
recorded first query is the question itself.

Its figures: `docs/benchmarks/serper_cache.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import REPO, SHARED

STANDIN = REPO / "tests" / "search_r1" / "serper_standin.py"
KEY = "inflight-benchmark-key"
SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
INFORMATION = re.compile(r"<information>.*?</information>", re.DOTALL)
CHARS_PER_TOKEN = 4  # a rough English average for Qwen2's tokenizer; only the turns' relative lengths matter here


def turns_of(response: str) -> list[tuple[int, str]]:
    """(tokens generated before the search, query) per search of a recorded response."""
    turns = []
    for segment in INFORMATION.split(response):
        match = SEARCH.search(segment)
        if match:
            turns.append((max(1, match.end() // CHARS_PER_TOKEN), match.group(1).strip()))
    return turns


def load_trajectories(paths: list[Path], seed: int) -> list[dict]:
    """Question and turns of every recorded trajectory, shuffled: steps mix datasets, as a shuffled training set."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    rows = [{"question": row["question"], "turns": turns_of(row["response"])} for row in rows]
    random.Random(seed).shuffle(rows)
    return rows


def first_query_is_the_question(rows: list[dict]) -> float:
    from slime_search.search_r1.serper_cache import normalise_query

    with_search = [row for row in rows if row["turns"]]
    same = sum(
        normalise_query(row["turns"][0][1]).rstrip("?") == normalise_query(row["question"]).rstrip("?")
        for row in with_search
    )
    return same / max(1, len(with_search))


def sample_queries(turns: list[tuple[int, str]], agreement: float, tag: str, rng: random.Random) -> list[str]:
    """One sample's queries: the recorded ones while it agrees with its group (each turn with probability
    `agreement`), its own from the first turn it does not (other observations, another trajectory from there)."""
    queries, agrees = [], True
    for _, query in turns:
        agrees = agrees and rng.random() < agreement
        queries.append(query if agrees else f"{query} [{tag}]")
    return queries


async def run_step(url: str, groups: list[dict], n: int, share: bool, pace: tuple[float, float, float], seed: int):
    from slime_search.search_r1.search_clients import SerperClient, SerperConfig

    ms_per_token, jitter, agreement = pace
    client = SerperClient(SerperConfig(endpoint=url, share_in_flight=share, backoff_base_s=0.01))
    origins = {"api": 0, "shared": 0, "cache": 0}
    rng = random.Random(seed)  # the same samples in both passes of a step

    async def sample(delays: list[float], queries: list[str]):
        for delay, query in zip(delays, queries, strict=True):
            await asyncio.sleep(delay)
            _, origin = await client.search_with_origin(query)
            origins[origin] += 1

    jobs = []
    for g, row in enumerate(groups):
        for k in range(n):
            delays = [tokens * ms_per_token / 1000 * rng.uniform(1 - jitter, 1 + jitter) for tokens, _ in row["turns"]]
            jobs.append(sample(delays, sample_queries(row["turns"], agreement, f"sample {g}.{k}", rng)))
    start = time.perf_counter()
    try:
        await asyncio.gather(*jobs)
    finally:
        await client.close()
    return {**origins, "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trajectories", nargs="+", default=sorted(str(p) for p in SHARED.glob("trajectories/*.jsonl"))
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=5, help="GRPO's samples per prompt")
    parser.add_argument("--latency-ms", type=float, default=100.0, help="how late the stand-in answers a search")
    parser.add_argument("--ms-per-token", type=float, default=2.0, help="generation pace of a sample's turn")
    parser.add_argument("--jitter", type=float, default=0.3, help="per-sample pace spread (0: a group in lockstep)")
    parser.add_argument(
        "--agreement",
        type=float,
        default=1.0,
        help="chance a sample asks its group's query at a turn, until it does not",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serper-url", default=None, help="a running stand-in's /search (default: start one)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.trajectories]
    if not paths or not all(p.is_file() for p in paths):
        print(f"no trajectories at {args.trajectories} (../shared/data is not beside this checkout)", file=sys.stderr)
        return 2
    rows = load_trajectories(paths, args.seed)
    needed = args.steps * args.prompts_per_step
    if len(rows) < needed:
        print(f"{len(rows)} trajectories, {needed} needed", file=sys.stderr)
        return 2

    from slime_search.utils.server_process import ServerProcess

    os.environ["SERPER_API_KEY"] = KEY
    standin = [str(STANDIN), "--port", "0", "--api-key", KEY, "--latency-ms", str(args.latency_ms)]
    totals = {"searches": 0, "billed_unshared": 0, "billed_shared": 0}
    with ServerProcess(standin) if args.serper_url is None else contextlib.nullcontext() as server:
        url = args.serper_url or f"{server.url}/search"
        for step in range(args.steps):
            groups = rows[step * args.prompts_per_step : (step + 1) * args.prompts_per_step]
            pace = (args.ms_per_token, args.jitter, args.agreement)
            unshared = asyncio.run(run_step(url, groups, args.n_samples, False, pace, args.seed + step))
            shared = asyncio.run(run_step(url, groups, args.n_samples, True, pace, args.seed + step))
            searches = sum(unshared[k] for k in ("api", "shared", "cache"))
            totals["searches"] += searches
            totals["billed_unshared"] += unshared["api"]
            totals["billed_shared"] += shared["api"]
            line = {"step": step, "samples": len(groups) * args.n_samples, "searches": searches}
            line |= {"billed_unshared": unshared["api"], "billed_shared": shared["api"], "shared": shared["shared"]}
            line |= {"saved": unshared["api"] - shared["api"], "seconds": [unshared["seconds"], shared["seconds"]]}
            print(json.dumps(line), flush=True)
    saved = totals["billed_unshared"] - totals["billed_shared"]
    summary = {
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "n_samples": args.n_samples,
        "agreement": args.agreement,
        **totals,
        "saved_per_step": round(saved / args.steps, 1),
        "saved_fraction": round(saved / max(1, totals["billed_unshared"]), 4),
        "first_query_is_the_question": round(first_query_is_the_question(rows), 4),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
