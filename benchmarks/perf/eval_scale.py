"""What the Search-R1 table and `--compare` cost at the seven test sets' full size: their time and the memory they
add, on synthetic grades.

    python -m benchmarks.perf.eval_scale [--scale 1.0] [--seed 0]

It makes graded rows for NQ 3,610, TriviaQA 11,313, PopQA 14,267, HotpotQA 7,405, 2wiki 12,576, Musique 2,417 and
Bamboogle 125 questions (51,713). `--scale` takes that share of every set, at least one question each. EM is 0/1 at the
set's rate. F1 is 1 where EM is 1, and otherwise a score with as many distinct values as questions (the worst case for
the bootstrap). Run B differs from run A on one question in ten.

It times the evaluation's metrics: per set and pooled, the reward key and EM with their intervals. These are what
`slime_search.eval` prints and training logs. It times the table: EM about the population and about each set, and F1,
per set and on the average. It times `--compare` on EM and on F1, and the whole
`python -m slime_search.eval --compare A B` on grade files. Then it measures each again under tracemalloc (numpy reports
its arrays to it). That gives the peak memory the call allocates beyond its input. The whole command is the exception:
its peak holds the rows it reads. Prints a Markdown table (docs/benchmarks/eval.md).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

import numpy as np

# (set, questions in Search-R1's evaluation, a plausible EM for a 3B policy)
FULL_SETS = (
    ("nq", 3610, 0.42),
    ("triviaqa", 11313, 0.58),
    ("popqa", 14267, 0.41),
    ("hotpotqa", 7405, 0.28),
    ("2wikimultihopqa", 12576, 0.27),
    ("musique", 2417, 0.06),
    ("bamboogle", 125, 0.10),
)


def synthetic_runs(scale: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Graded rows of two runs over the same questions (ids 0..n-1 per set)."""
    from slime_search.evaluation.table import graded_row

    rng = np.random.default_rng(seed)
    a_rows, b_rows = [], []
    for source, size, rate in FULL_SETS:
        n = max(1, round(size * scale))
        a_em = (rng.random(n) < rate).astype(float)
        b_em = np.where(rng.random(n) < 0.1, 1.0 - a_em, a_em)
        for em_values, rows in ((a_em, a_rows), (b_em, b_rows)):
            f1 = np.where(em_values == 1.0, 1.0, rng.random(n) * 0.8)
            for i in range(n):
                reward = {"em": float(em_values[i]), "f1": float(f1[i]), "format_valid": 1.0}
                rows.append(graded_row(source, f"{source} question {i}", reward, {"searches": 1, "turns": 2}, None, str(i)))  # fmt: skip
    return a_rows, b_rows


def as_samples(rows: list[dict]) -> list:
    """The graded rows as the evaluated samples they would come from (reward, set, search counts)."""
    from slime_search.types import Sample, Status

    return [
        Sample(
            reward={"score": row["em"], "em": row["em"], "f1": row["f1"], "format_valid": row["format_valid"]},
            status=Status.COMPLETED,
            metadata={"data_source": row["source"]},
            metrics={"searches": row["searches"], "turns": row["turns"]},
        )
        for row in rows
    ]


def compare_command(a_rows: list[dict], b_rows: list[dict]):
    """`python -m slime_search.eval --compare A B` on the two runs' grade files, its printout discarded."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    from slime_search import eval as eval_cli
    from slime_search.evaluation.table import write_rows

    folder = Path(tempfile.mkdtemp(prefix="eval-scale-"))
    paths = [folder / "a.grades.jsonl", folder / "b.grades.jsonl"]
    for path, rows in zip(paths, (a_rows, b_rows), strict=True):
        write_rows(path, rows)

    def run():
        with contextlib.redirect_stdout(io.StringIO()):
            assert eval_cli.main(["--compare", *map(str, paths)]) == 0

    return run, folder


def measure(call) -> tuple[float, float]:
    """Seconds of one call, and the peak MiB it allocates (a second call, under tracemalloc, which slows it)."""
    started = time.perf_counter()
    call()
    seconds = time.perf_counter() - started
    tracemalloc.start()
    try:
        call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, peak / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="the share of every set's full size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import shutil

    from slime_search.evaluation.intervals import RESAMPLES
    from slime_search.evaluation.table import compare_runs, search_r1_table
    from slime_search.rollout.eval_metrics import evaluate_samples

    a_rows, b_rows = synthetic_runs(args.scale, args.seed)
    samples = as_samples(a_rows)
    command, folder = compare_command(a_rows, b_rows)
    print(f"{len(a_rows)} questions in {len(FULL_SETS)} sets, {RESAMPLES} bootstrap resamples per interval\n")
    print("| call | time | peak memory added |")
    print("|---|---|---|")
    calls = (
        ("metrics (per set and pooled: score and EM with intervals)", lambda: evaluate_samples(samples)),
        ("table (EM about the population and about each set, F1)", lambda: search_r1_table(a_rows)),
        ("--compare, EM", lambda: compare_runs(a_rows, b_rows, metric="em")),
        ("--compare, F1", lambda: compare_runs(a_rows, b_rows, metric="f1")),
        ("python -m slime_search.eval --compare A B (reads both grade files)", command),
    )
    try:
        for label, call in calls:
            seconds, mib = measure(call)
            print(f"| {label} | {seconds:.2f} s | {mib:.1f} MiB |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
