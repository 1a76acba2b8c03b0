"""The guard's reward and held-out rules at the two shapes the project runs, by simulation through the real HealthGuard.

    python -m benchmarks.studies.guard_shapes --runs 100                      # both shapes, every scenario, the defaults
    python -m benchmarks.studies.guard_shapes --runs 100 --resample 1.0       # evaluations independent of each other
    python -m benchmarks.studies.guard_shapes --runs 100 --health-eval-drop 0.2 ...   # any --health-* bound instead

Shapes (one set of guard defaults must serve both):

    recipe     the 3B recipe (examples/search-r1/run_qwen2.5_3B.sh): 1,000 steps; training reward 0.1 -> 0.4 with a
               per-step sd of 0.05 (32 prompts x 8 samples); held-out EM 0.1 -> 0.42, evaluated every 25 steps on
               3,000 questions (nq_test[0:3000])
    miniature  the CPU main job (examples/search-r1/run_miniature_cpu.sh as docs/benchmarks/health.md runs it): 40
               steps; reward and EM 0.06 -> 0.95 within ~20 steps, reward sd 0.08 per step (8 prompts x 8 samples);
               EM evaluated every 2 steps on 64 questions

Scenarios: `healthy` (the curve alone: any rollback is a false one); `collapse`: from a random step of the plateau, the
held-out EM and the training reward fall linearly to --collapse-to times the level over --collapse-steps steps. They
stay there: the recipe's 0.42 -> 0.25 over 100 steps, the miniature's 0.95 -> 0.5 over 6; `collapse, held-out only` (the
training reward goes on as if healthy: what the held-out rule alone catches). Every question has a latent difficulty u,
and a version answers it when u is below its accuracy. So each evaluation grades at the version's accuracy, binomially
over questions. `--resample`, the share of u drawn anew from one evaluation to the next, sets how alike nearby versions
grade; the guard gets the grades (the paired test of health.heldout).

A run ends at its first rollback. Printed per shape and scenario: the runs rolled back and the rules that acted. For the
collapses it also prints the share rolled back within 3 evaluations of the collapse's first step (counted from the first
evaluation after it), and the median delay in evaluations. A markdown table (docs/benchmarks/health.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import Counter

from benchmarks.harness.curves import SHAPES, Shape, healthy
from slime_search.health.config import HealthConfig, add_health_arguments, health_config

SCENARIOS = ("healthy", "collapse", "collapse, held-out only")
WITHIN = 3  # evaluations from a collapse's start within which its rollback should come


def collapse_factor(shape: Shape, t: float, start: int | None) -> float:
    """What the collapse leaves of the healthy curve at step `t` (1.0 before it, or without one)."""
    if start is None or t <= start:
        return 1.0
    return 1.0 - (1.0 - shape.collapse_to) * min(1.0, (t - start) / shape.collapse_steps)


def step_record(step: int, reward: float) -> dict[str, float]:
    """A healthy step but for its reward: every other signal flat."""
    return {
        "step": step,
        "time/step_s": 1.0,
        "rollout/reward_mean": reward,
        "rollout/response_length_p90": 100.0,
        "rollout/truncation_rate": 0.0,
        "train/entropy": 1.0,
        "train/grad_norm": 1.0,
        "train/grad_norm_max": 1.0,
        "train/steps": 1.0,
        "train/steps_applied": 1.0,
        "train/kl_old_new": 0.01,
    }


def simulate(rng, shape: Shape, scenario: str, config: HealthConfig, resample: float) -> dict:
    """One run through the real guard; returns where it began to collapse and its first rollback, if any."""
    import numpy as np

    from slime_search.health.guard import HealthGuard

    guard = HealthGuard(config)
    start = None if scenario == "healthy" else int(rng.integers(*shape.collapse_from))
    reward_start = None if scenario == "collapse, held-out only" else start
    latent = rng.random(shape.questions)
    for step in range(shape.steps + 1):
        if step % shape.eval_interval == 0 or step == shape.steps:
            redraw = rng.random(shape.questions) < resample
            latent = np.where(redraw, rng.random(shape.questions), latent)
            accuracy = healthy(shape, shape.em_level, step) * collapse_factor(shape, step, start)
            grades = (latent < accuracy).astype(float).tolist()
            events = guard.review_eval(step, {"eval/score": sum(grades) / len(grades)}, grades)
            if rollback := next((e for e in events if e.action == "rollback"), None):
                return {"start": start, "rollback": rollback}
        if step == shape.steps:
            break
        mean = healthy(shape, shape.reward_level, step) * collapse_factor(shape, step, reward_start)
        reward = float(np.clip(mean + rng.normal(0.0, shape.reward_sd), 0.0, 1.0))
        events = guard.review(step, step_record(step, reward))
        if rollback := next((e for e in events if e.action == "rollback"), None):
            return {"start": start, "rollback": rollback}
    return {"start": start, "rollback": None}


def evaluations_until(shape: Shape, start: int, step: int) -> int:
    """Evaluations from the collapse's start to the rollback at `step` (the evaluation of version `step` counted)."""
    return sum(1 for v in range(start + 1, step + 1) if v % shape.eval_interval == 0 or v == shape.steps)


def measure(shape: Shape, scenario: str, config: HealthConfig, runs: int, resample: float, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    results = [simulate(rng, shape, scenario, config, resample) for _ in range(runs)]
    rolled = [r for r in results if r["rollback"] is not None]
    delays = [evaluations_until(shape, r["start"], r["rollback"].step) for r in rolled if r["start"] is not None]
    return {
        "rolled_back": len(rolled),
        "within": sum(1 for d in delays if 1 <= d <= WITHIN),  # a rollback before the collapse began is a false one
        "delay": statistics.median(delays) if delays else float("nan"),
        "rules": Counter(r["rollback"].rule for r in rolled),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="simulated runs per shape and scenario")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--resample", type=float, default=0.3, help="share of questions graded anew per evaluation")
    parser.add_argument("--seed", type=int, default=0)
    add_health_arguments(parser)
    args = parser.parse_args(argv)
    config = health_config(args)
    print(f"| shape | scenario | runs | rolled back | within {WITHIN} evaluations of the start | median delay "
          "(evaluations) | rules |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        for scenario in args.scenarios:
            row = measure(SHAPES[name], scenario, config, args.runs, args.resample, args.seed)
            within = "" if scenario == "healthy" else f"{row['within']}"
            delay = "" if scenario == "healthy" or math.isnan(row["delay"]) else f"{row['delay']:g}"
            rules = ", ".join(f"{rule} {n}" for rule, n in row["rules"].most_common()) or "none"
            print(f"| {name} | {scenario} | {args.runs} | {row['rolled_back']} | {within} | {delay} | {rules} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
