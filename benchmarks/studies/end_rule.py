"""What the guard's end-of-run rule does on runs that end flat and on runs that fall late, by simulation.

    python -m benchmarks.studies.end_rule --runs 2000 --questions 64 --evals 11 --fresh 500 --falls 0 0.05 0.1 0.2

Each simulated run is K held-out evaluations of the same n questions plus a pool of m questions they leave out
(`--eval-sample` evaluates a subset of a larger set; `--health-end-confirm` grades the rest). Every question has a
latent difficulty u; a version gets it right when u < its accuracy. So each evaluation's share right has the version's
accuracy exactly. `--resample`, the share of u drawn anew from one version to the next, sets how alike nearby versions
grade the same question. A flat run keeps its accuracy; a falling run loses --falls at one of its last three evaluations
(the held-out rule, waiting --health-eval-patience 4 evaluations, one step apart here, never rolls those back: the
end-of-run rule is the guard's only answer to them).

The real HealthGuard sees every evaluation with its grades (every version has a checkpoint; the last is the final
version's, as the end rule requires), then decides as the run's end does (run.recovery.Recovery.end): end_on_best
when the evaluations settle the fall; otherwise, for an end_candidate and with a pool to confirm on, end_on_confirmed
on the pool's grades of both versions. Printed per
--health-end-drop and with the confirmation off and on: the share of runs ending on an earlier checkpoint, the share
that spent a confirmation, and the mean accuracy of the weights the run ends on against its last weights'.

Its figures: `docs/benchmarks/health.md`.
"""

from __future__ import annotations

import argparse
import sys


def simulate(rng, questions: int, accuracies: list[float], resample: float):
    """Per version, the 0/1 grades of `questions` questions (a K x n boolean array), from latent difficulties of
    which a share `resample` is drawn anew from one version to the next."""
    import numpy as np

    latent = rng.random(questions)
    grades = []
    for accuracy in accuracies:
        redraw = rng.random(questions) < resample
        latent = np.where(redraw, rng.random(questions), latent)
        grades.append(latent < accuracy)
    return np.array(grades)


def accuracies(evals: int, accuracy: float, fall: float, fall_at: int) -> list[float]:
    return [accuracy - fall if k >= fall_at else accuracy for k in range(evals)]


def ends_on(grades, evaluated: int, end_drop: float, confirm: int) -> tuple[int, bool]:
    """(the version the run ends on, whether a confirmation was spent), the guard deciding as Recovery.end does."""
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard

    guard = HealthGuard(HealthConfig(end_drop=end_drop, end_confirm=confirm))
    for version, row in enumerate(grades):
        shown = row[:evaluated].astype(float).tolist()
        guard.review_eval(version, {"eval/score": sum(shown) / len(shown)}, shown)
    versions, final = list(range(len(grades))), len(grades) - 1
    event = guard.end_on_best(versions)
    if event is not None:
        return int(event.values["ended_on"]), False
    candidate = guard.end_candidate(versions)
    if candidate is None or not confirm or len(grades[0]) == evaluated:
        return final, False
    pool = slice(evaluated, evaluated + confirm)
    best, last = (grades[v][pool].astype(float).tolist() for v in (candidate[0], final))
    event = guard.end_on_confirmed(candidate[0], best, last)
    return (int(event.values["ended_on"]) if event is not None else final), True


def measure(args, fall: float) -> dict[tuple[float, int], dict[str, float]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    runs = []
    for _ in range(args.runs):
        fall_at = int(rng.integers(args.evals - 3, args.evals)) if fall else args.evals
        truth = accuracies(args.evals, args.accuracy, fall, fall_at)
        runs.append((truth, simulate(rng, args.questions + args.fresh, truth, args.resample)))
    out = {}
    for end_drop in args.end_drops:
        for confirm in (0, args.fresh):
            earlier = spent = 0
            ended, last = 0.0, 0.0
            for truth, grades in runs:
                version, confirmed = ends_on(grades, args.questions, end_drop, confirm)
                earlier += version != args.evals - 1
                spent += confirmed
                ended, last = ended + truth[version], last + truth[-1]
            out[(end_drop, confirm)] = {
                "earlier": earlier / args.runs,
                "confirmed": spent / args.runs,
                "ended": ended / args.runs,
                "last": last / args.runs,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated runs per fall")
    parser.add_argument("--questions", type=int, default=64, help="questions each evaluation grades")
    parser.add_argument("--fresh", type=int, default=500, help="questions they leave out (--health-end-confirm)")
    parser.add_argument("--evals", type=int, default=11, help="evaluations per run")
    parser.add_argument("--accuracy", type=float, default=0.95)
    parser.add_argument("--falls", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2], help="0: a flat run")
    parser.add_argument("--end-drops", type=float, nargs="+", default=[0.05, 0.1], help="--health-end-drop")
    parser.add_argument("--resample", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.evals < 4 or args.fresh < 0 or args.questions < 2:
        parser.error("--evals at least 4, --questions at least 2, --fresh not negative")
    print("| fall | --health-end-drop | confirm on | ends earlier | confirmations | accuracy ended on | last weights |")
    print("|---|---|---|---|---|---|---|")
    for fall in args.falls:
        for (end_drop, confirm), row in measure(args, fall).items():
            print(
                f"| {fall:g} | {end_drop:g} | {confirm} | {row['earlier']:.3f} | {row['confirmed']:.3f} | "
                f"{row['ended']:.4f} | {row['last']:.4f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
