"""How long evaluating the seven Search-R1 test sets takes on the GPU recipe's engines, estimated with emulated H100s.

    python -m benchmarks.perf.eval_time_emulated [--engines 2] [--questions 3125] [--time-scale 0.25]

It takes the questions with recorded Search-R1 3B trajectories: NQ, TriviaQA, PopQA 1,000 each and Bamboogle 125, from
../shared/data/trajectories. They go through `python -m slime_search.eval` as the recipe would evaluate them: greedy,
with the Search-R1 generate plugin, its default limits and concurrency. They run against a BM25 retriever over the
wiki-18 subset and `--engines` emulated SGLang engines. Those engines (benchmarks.harness.stand_in_engines.emulated)
serve the recorded turns, paced by a continuous-batching model of Qwen2.5-3B on one H100. The recipe
examples/search-r1/run_qwen2.5_3B.sh serves with 2 engines of TP 2; each is emulated as one H100, which a TP-2 engine is
not slower than. The emulated seconds (wall / time scale) per question, times 51,713 (the seven full sets), estimate the
full evaluation; Search-R1 reports about 6,000 s for it. The retriever and the evaluation's own Python run at this
machine's pace, not the time scale's: below a time scale of 1 their share is stretched, and the engines' busy share
(printed) says how much of the time was theirs. Prints the figures (docs/benchmarks/eval.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.paths import SHARED

TRAJECTORIES = ("nq", "triviaqa", "popqa", "bamboogle")
FULL_QUESTIONS = (
    51_713  # NQ 3,610, TriviaQA 11,313, PopQA 14,267, HotpotQA 7,405, 2wiki 12,576, Musique 2,417, Bamboogle 125
)
SEARCH_R1_REPORTED_S = 6_000


def write_sets(out: Path, limit: int) -> list[tuple[str, Path]]:
    """Search-R1 test rows of the recorded questions, one file per set, `limit` questions in all (in set order)."""
    from slime_search.search_r1.prompt import make_row

    sets, left = [], limit
    for name in TRAJECTORIES:
        lines = (SHARED / "trajectories" / f"search_r1_3b_base_{name}.jsonl").read_text().splitlines()[:left]
        if not lines:
            break
        rows = []
        for i, line in enumerate(lines):
            row = json.loads(line)
            rows.append(
                make_row({"question": row["question"], "golden_answers": row["golden_answers"]}, name, "test", i)
            )
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        sets.append((name, path))
        left -= len(rows)
    return sets


def engine_states(urls: list[str]) -> list[dict]:
    import httpx

    return [httpx.get(f"{url}/server_info", timeout=30).json()["internal_states"][0] for url in urls]


def estimate(questions: int, emulated_s: float, engines: int, recipe_engines: int = 2) -> float:
    """Seconds for all seven sets on the recipe's engines: the measured pace per question, scaled to 51,713 questions
    and from `engines` to the recipe's (evaluation keeps every engine's batch full, so it scales with their number)."""
    return emulated_s / questions * FULL_QUESTIONS * engines / recipe_engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2, help="emulated engines (the recipe: 2)")
    parser.add_argument("--questions", type=int, default=3125, help="recorded questions to evaluate (at most 3,125)")
    parser.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per emulated second")
    args = parser.parse_args(argv)
    if not (SHARED / "trajectories").is_dir():
        print(f"needs the Search-R1 trajectories and corpus under {SHARED}", file=sys.stderr)
        return 2

    import contextlib
    import io

    from local_dense_retriever import build_index
    from local_dense_retriever.launch import RetrievalServerProcess
    from slime_search import eval as eval_cli
    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.utils.server_process import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="bench-eval-time-"))
    tokenizer = save_tiny_checkpoint(work / "tiny")  # the Qwen2 tokenizer: all the emulated engines need of a model
    corpus = SHARED / "corpus" / "wiki18_subset.jsonl"
    build_index.main(["--retriever-name", "bm25", "--corpus-path", str(corpus), "--save-dir", str(work)])
    sets = write_sets(work, args.questions)
    questions = sum(len(path.read_text().splitlines()) for _, path in sets)
    engine_argv = [
        "-m", "benchmarks.harness.stand_in_engines.emulated", "--tokenizer", str(tokenizer), "--port", "0",
        "--time-scale", str(args.time_scale),
        "--trajectories", *(str(SHARED / "trajectories" / f"search_r1_3b_base_{n}.jsonl") for n in TRAJECTORIES),
    ]  # fmt: skip
    retriever_args = ["--retriever-name", "bm25", "--index-path", str(work / "bm25"), "--corpus-path", str(corpus)]
    with RetrievalServerProcess(*retriever_args, "--topk", "3") as retriever:
        engines = [ServerProcess(engine_argv, timeout=300) for _ in range(args.engines)]
        try:
            flags = [
                "--hf-checkpoint", str(tokenizer), "--apply-chat-template",
                "--eval-prompt-data", *(str(item) for pair in sets for item in pair),
                "--search-url", f"{retriever.url}/retrieve", "--engine-url", ",".join(e.url for e in engines),
                "--output", str(work / "eval.json"),
            ]  # fmt: skip
            started = time.monotonic()
            with contextlib.redirect_stdout(io.StringIO()):
                assert eval_cli.main(flags) == 0
            wall = time.monotonic() - started
            busy = [state["busy_s"] for state in engine_states([e.url for e in engines])]
        finally:
            for engine in engines:
                engine.stop()
    metrics = json.loads((work / "eval.json").read_text())
    shutil.rmtree(work, ignore_errors=True)  # the index, the tokenizer and the samples: nothing kept
    emulated = wall / args.time_scale
    full = estimate(questions, emulated, args.engines)
    print(f"{questions} questions, {args.engines} emulated H100 engine(s), time scale {args.time_scale}")
    print(f"wall {wall:.1f} s = {emulated:.0f} emulated s ({emulated / questions * 1000:.1f} ms a question)")
    print(
        f"EM {metrics['eval/em']:.3f}, turns {metrics['eval/turns']:.2f}, search rate {metrics['eval/search_rate']:.3f}"
    )
    print(f"engines busy {', '.join(f'{b / emulated:.0%}' for b in busy)} of the emulated time")
    print(f"seven full sets ({FULL_QUESTIONS} questions) on the recipe's 2 engines: about {full:.0f} s")
    # the engines' own time alone: what the evaluation would take if this machine's side kept them busy
    print(f"engine-bound (their busy time alone): about {estimate(questions, sum(busy), 1):.0f} s")
    print(f"Search-R1 reports about {SEARCH_R1_REPORTED_S} s: {SEARCH_R1_REPORTED_S / full:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
