"""The guard week's command line: the weeks of the seeds asked for, judged, as a markdown table and JSON."""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path

from benchmarks.studies.guard_week.shapes import SHAPES


def eval_window(week) -> int:
    """Steps a held-out fall needs to be seen: --health-eval-patience evaluations, and beside training the lag of two
    evaluations at their slowest (one running, one waiting) in the shortest steps."""
    config, timing = week.config, week.shape.timing
    window = config.health.eval_patience * max(1, config.eval_interval)
    if config.eval_engine is not None:
        slowest = timing.eval_load_s + sum(week.eval_sizes.values()) * timing.eval_s_per_question[1]
        window += int(2 * slowest / (timing.rollout_s[0] + timing.train_s[0])) + 1
    return window


def one_week(shape: str, seed: int, work: Path, args) -> dict:
    import numpy as np

    from benchmarks.studies.guard_week.faults import faults_for, place
    from benchmarks.studies.guard_week.judge import judge, verdict
    from benchmarks.studies.guard_week.shapes import setup
    from benchmarks.studies.guard_week.week import run_week
    from benchmarks.studies.guard_week.world import World
    from slime_search.run.folder import RunFolder

    started = time.perf_counter()
    run_dir = work / f"{shape}-seed{seed}"
    week = setup(shape, work, run_dir, args.eval_beside, args.extra, args.steps)
    config = week.config
    catalogue = faults_for(config.eval_engine is not None, config.health.patience, eval_window(week))
    kinds = args.faults or week.shape.default_faults
    unknown = sorted(set(kinds) - set(catalogue))
    if unknown:
        raise SystemExit(f"--faults: unknown {unknown}; valid: {', '.join(catalogue)}")
    rng = np.random.default_rng(seed)
    first = 2 * max(config.save_interval, config.eval_interval)
    faults = place(kinds, catalogue, rng, config.num_rollout, first, tail=config.eval_interval)
    world = World(week, rng, faults)
    outcome = run_week(world, week.argv)
    result = {"shape": shape, "seed": seed, **judge(world, catalogue, RunFolder(run_dir), outcome)}
    result["met_every_target"] = verdict(result)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def table(results: list[dict]) -> str:
    rows = [
        "| seed | faults (step) | right action | actions outside the faults | stops on passing faults | lost | peak on "
        "disk (budget: checkpoints) | final step (expected) | starts | simulated time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        faults = ", ".join(f"{k} ({v})" for k, v in sorted(r["faults"].items(), key=lambda kv: kv[1]))
        unreached = [k for k, why in r["problems"].items() if why.startswith("not reached")]
        wrong = [k for k, ok in r["right_action"].items() if not ok and k not in unreached]
        right = f"{len(r['right_action']) - len(wrong) - len(unreached)} of {len(r['right_action'])}"
        notes = ([f"not: {', '.join(wrong)}"] if wrong else []) + (
            [f"not reached: {len(unreached)}"] if unreached else []
        )
        right += f" ({'; '.join(notes)})" if notes else ""
        outside = len(r["outside_windows"])
        outside_text = f"{outside}" + (f": {r['outside_windows'][:3]}" if outside else "")
        peak, budget = r["peak_bytes"] / 1e9, (r["budget_bytes"] or 0) / 1e9
        final = (r["final"] or {}).get("step")
        rows.append(
            f"| {r['seed']} | {faults} | {right} | {outside_text} | {len(r['stops_on_passing_faults'])} | "
            f"{r['checkpoints_lost']} | {peak:.1f} GB ({budget:.1f} GB: {r['budget_checkpoints']}) | {final} "
            f"({r['final_expected']}) | {r['starts']} | {r['sim_hours']:.1f} h |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.studies.guard_week import __doc__ as doc

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="miniature")
    parser.add_argument("--steps", type=int, default=None, help="steps of the run (the recipe: its NUM_ROLLOUT)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--faults", nargs="+", default=None, help="the faults to inject (default: the shape's)")
    parser.add_argument("--eval-beside", action="store_true", help="the recipe with --eval-engine and the seven sets")
    parser.add_argument("--recipe-flags", default="", help="flags appended to the run's command line (quoted)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    args.extra = shlex.split(args.recipe_flags)
    import logging

    import ray

    logging.basicConfig(level=logging.ERROR)
    started = not ray.is_initialized()  # a caller's Ray (a test session's) is used as it is
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="guard-week-") as work:
            for seed in args.seeds:
                results.append(one_week(args.shape, seed, Path(work), args))
                print(json.dumps(results[-1]), flush=True)
    finally:
        if started:
            ray.shutdown()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
