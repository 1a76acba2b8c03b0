"""How often the evaluation's 95% intervals hold the number they estimate, and how wide they are, per subset size.

    python -m benchmarks.studies.eval_intervals GRADES.jsonl [--sizes 64 128 256 400] [--draws 1000]

GRADES.jsonl is one graded row per question (`python -m slime_search.eval ... --output X.json` writes X.grades.jsonl;
`--grade` makes one from trajectories). Each set's full EM is the truth; for each size, `--draws` fixed-seed subsets of
each set (as --eval-sample draws them, without replacement) get their bootstrap interval about the whole set's EM. That
is the table's "about this set's EM" row, narrowed by the finite-population factor. The share of intervals that holds
the full set's EM is the coverage. The average over sets is checked the same way. Prints a Markdown table
(docs/benchmarks/eval.md).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from slime_search.evaluation.intervals import average_over_sets_interval, bootstrap_interval, questions_for_width
from slime_search.evaluation.subsets import fixed_subset
from slime_search.evaluation.table import AVERAGE, by_source, ordered_sources, read_rows


def coverage(values: list[float], size: int, draws: int, resamples: int, name: str) -> tuple[float, float]:
    """The share of `draws` subsets of `size` whose interval holds the mean of all `values`, and the mean width."""
    truth = float(np.mean(values))
    held, widths = 0, []
    for draw in range(draws):
        subset = [values[i] for i in fixed_subset(len(values), size, draw, name)]
        interval = bootstrap_interval(subset, seed=draw, resamples=resamples, population=len(values))
        held += interval.low <= truth <= interval.high
        widths.append(interval.high - interval.low)
    return held / draws, float(np.mean(widths))


def average_coverage(values_by_set: dict[str, list[float]], size: int, draws: int, resamples: int):
    truth = float(np.mean([np.mean(v) for v in values_by_set.values()]))
    held, widths = 0, []
    for draw in range(draws):
        subsets = {
            name: [values[i] for i in fixed_subset(len(values), size, draw, name)]
            for name, values in values_by_set.items()
        }
        sizes = {name: len(values) for name, values in values_by_set.items()}
        interval = average_over_sets_interval(subsets, seed=draw, resamples=resamples, populations=sizes)
        held += interval.low <= truth <= interval.high
        widths.append(interval.high - interval.low)
    return held / draws, float(np.mean(widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grades", help="one graded row per question (.grades.jsonl)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 400])
    parser.add_argument("--draws", type=int, default=1000, help="subsets per set and size")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per interval")
    args = parser.parse_args(argv)
    sets = {name: [r["em"] for r in group] for name, group in by_source(read_rows(args.grades)).items()}
    print(f"{args.draws} subsets per set and size, {args.resamples} bootstrap resamples each\n")
    print("| set (questions, full EM) | subset | coverage of the full EM | mean width | normal-theory width |")
    print("|---|---|---|---|---|")
    for name in [*ordered_sources(sets), AVERAGE]:
        values = sets.get(name)
        for size in args.sizes:
            if name == AVERAGE:
                covered, width = average_coverage(sets, size, args.draws, args.resamples)
                label, expected = f"average of {len(sets)} sets", "-"
            elif size >= len(values):
                continue
            else:
                covered, width = coverage(values, size, args.draws, args.resamples, name)
                label = f"{name} ({len(values)}, {np.mean(values):.3f})"
                p = float(np.mean(values))
                factor = np.sqrt((len(values) - size) / (len(values) - 1))
                expected = f"{2 * 1.96 * np.sqrt(p * (1 - p) / size) * factor:.3f}"
            print(f"| {label} | {size} | {covered:.3f} | {width:.3f} | {expected} |")
    print(
        f"\nquestions for a width of 0.10 (worst case): {questions_for_width(0.1)}; of 0.05: {questions_for_width(0.05)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
