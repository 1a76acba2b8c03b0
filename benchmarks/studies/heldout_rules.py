"""How often the guard's held-out rule fires on runs that did not fall, and how surely and soon on runs that did.

    python -m benchmarks.studies.heldout_rules --runs 2000 --questions 64 128 --evals 10 20 --resample 1.0 0.3

Each simulated run is K evaluations of the same n questions. A question's grade is kept from one evaluation to the
next or, with probability --resample, drawn anew with the run's current accuracy: 1.0 makes evaluations independent,
smaller values correlate nearby versions as nearby checkpoints are. A flat run keeps its accuracy (0.5) throughout; a
falling run loses 0.3 at a random evaluation past the third and stays down (resampled 1.0 from there, so the fall
shows at once). Five rules, each run through the real HealthGuard where it can be (review_eval, with grades or not):

    unpaired, at once   the point estimate more than --health-eval-drop x the best below it: roll back (the former rule)
    unpaired, wait      the same, two evaluations in a row (--health-eval-patience 2)
    paired, at once     the drop beyond chance, paired per question, best chosen among K (health.heldout)
    paired, wait        both, two evaluations in a row
    paired, wait 4      both, four in a row (--health-eval-patience 4, the default): a fall in the last three of the K
                        evaluations is not rolled back at all; the end-of-run rule is there for those

False alarms: the share of flat runs rolled back. Caught: the share of falling runs rolled back, and the mean delay in
evaluations from the fall. Prints a markdown table (docs/benchmarks/health.md).
"""

from __future__ import annotations

import argparse
import sys

RULES = {  # name -> (pass grades to the guard, --health-eval-patience)
    "unpaired, at once": (False, 1),
    "unpaired, wait": (False, 2),
    "paired, at once": (True, 1),
    "paired, wait": (True, 2),
    "paired, wait 4 (the default)": (True, 4),
}


def simulate(rng, questions: int, evals: int, resample: float, accuracy: float, fall_at: int | None, fall: float):
    """The grades of each evaluation of one run (a list of K lists of 0/1)."""
    grades = rng.random(questions) < accuracy
    out = []
    for k in range(evals):
        p = accuracy - fall if fall_at is not None and k >= fall_at else accuracy
        redraw = rng.random(questions) < (1.0 if fall_at is not None and k == fall_at else resample)
        grades = (grades & ~redraw) | (redraw & (rng.random(questions) < p))
        out.append(grades.astype(float).tolist())
    return out


def first_rollback(run: list[list[float]], paired: bool, patience: int, eval_drop: float) -> int | None:
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard

    guard = HealthGuard(HealthConfig(eval_drop=eval_drop, eval_patience=patience))
    for k, grades in enumerate(run):
        events = guard.review_eval(k, {"eval/score": sum(grades) / len(grades)}, grades if paired else None)
        if any(e.action == "rollback" for e in events):
            return k
    return None


def measure(args, questions: int, evals: int, resample: float) -> dict[str, dict[str, float]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    flat = [simulate(rng, questions, evals, resample, args.accuracy, None, 0.0) for _ in range(args.runs)]
    falls = [int(rng.integers(3, evals)) for _ in range(args.runs)]
    falling = [simulate(rng, questions, evals, resample, args.accuracy, at, args.fall) for at in falls]
    out = {}
    for name, (paired, patience) in RULES.items():
        alarms = sum(first_rollback(run, paired, patience, args.eval_drop) is not None for run in flat)
        caught = [first_rollback(run, paired, patience, args.eval_drop) for run in falling]
        delays = [k - at for k, at in zip(caught, falls, strict=True) if k is not None and k >= at]
        out[name] = {
            "false_alarms": alarms / args.runs,
            "caught": len(delays) / args.runs,
            "delay": sum(delays) / len(delays) if delays else float("nan"),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated runs of each kind per setting")
    parser.add_argument("--questions", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--evals", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--resample", type=float, nargs="+", default=[1.0, 0.3])
    parser.add_argument("--accuracy", type=float, default=0.5)
    parser.add_argument("--fall", type=float, default=0.3, help="what a falling run loses, for good")
    parser.add_argument(
        "--eval-drop",
        type=float,
        default=0.4,
        help="--health-eval-drop, a share of the best: 0.4 of a best near 0.5 is about the margin of 0.2 the table "
        "in docs/benchmarks/health.md was measured with when the margin was absolute",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        "| questions | evaluations | resampled | rule | false alarms (flat runs) | caught (falling runs) | delay (evals) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.questions:
        for k in args.evals:
            for r in args.resample:
                for name, row in measure(args, n, k, r).items():
                    print(
                        f"| {n} | {k} | {r:g} | {name} | {row['false_alarms']:.3f} | {row['caught']:.3f} | "
                        f"{row['delay']:.2f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
