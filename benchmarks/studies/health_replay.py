"""What the health guard would have done on runs made without it. The guard is replayed over each run's records, step by
step. Its first action is set against the step at which the held-out metric first fell 0.2 (or another margin) below its
best so far.

    python -m benchmarks.studies.health_replay RUN [RUN ...] [--drop 0.2] [--flag value ...]

The guard is a function of a run's records (slime_search.health.guard), so replaying it over an unguarded run shows
when it would have warned and rolled back, without the rollback changing what follows. Guard settings other than the
defaults are given as `--health-...` flags of the training CLI. Prints a markdown table (docs/benchmarks/health.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness.guard_replay import replay
from slime_search.health.config import HealthConfig, add_health_arguments, health_config
from slime_search.health.guard import Event
from slime_search.utils.records import read_records


def first_drop(records: list[dict], key: str, margin: float) -> int | None:
    """The first version whose held-out `key` is more than `margin` below the best before it."""
    best = None
    for record in records:
        if key in record and "time/eval_s" in record:
            if best is not None and best - record[key] > margin:
                return record["step"]
            best = record[key] if best is None else max(best, record[key])
    return None


def summary(run: Path, config: HealthConfig, margin: float, key: str = "eval/em") -> dict:
    records = read_records(run / "metrics.jsonl")
    grades = {r["step"]: r["grades"] for r in read_records(run / "eval_grades.jsonl")}
    events = replay(records, config, grades)
    evals = [(r["step"], r[key]) for r in records if key in r and "time/eval_s" in r]
    signs = [e for e in events if e.action in ("warn", "watch")]  # a held-out fall the guard waits on is a first sign
    return {
        "run": run.name,
        "evals": evals,
        "drop_at": first_drop(records, key, margin),
        "warn": signs[0] if signs else None,
        "rollback": next((e for e in events if e.action == "rollback"), None),
        "warnings": len(signs),
        "end_on_best": next((e for e in events if e.action == "end_on_best"), None),
    }


def row(s: dict) -> str:
    def when(event: Event | None) -> str:
        return "never" if event is None else f"step {event.step} ({event.rule})"

    ems = " / ".join(f"{em:.3f}" for _, em in s["evals"])
    drop = "never" if s["drop_at"] is None else f"version {s['drop_at']}"
    lead = ""
    if s["drop_at"] is not None and s["rollback"] is not None:
        lead = f"{s['drop_at'] - s['rollback'].step:+d}"
    end = "last" if s["end_on_best"] is None else f"step {s['end_on_best'].values['ended_on']:.0f}"
    return (
        f"| {s['run']} | {ems} | {drop} | {when(s['warn'])} | {when(s['rollback'])} | {lead} | {s['warnings']} | "
        f"{end} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--drop", type=float, default=0.2, help="the held-out fall that counts as a collapse or a dip")
    add_health_arguments(parser)
    args = parser.parse_args(argv)
    config = health_config(args)
    print(
        f"| run | held-out EM by version | EM {args.drop} below its best | first warning or watch | first rollback | "
        "lead (versions) | warnings and watches | ends on |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        print(row(summary(run, config, args.drop)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
