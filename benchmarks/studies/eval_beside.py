"""What evaluation costs a training run, inside its steps vs beside them (--eval-engine), on the CPU miniature.

    python -m benchmarks.studies.eval_beside --run-dir runs/miniature [--seed 0] [--heldout 600] [--eval-interval 5]
    python -m benchmarks.studies.eval_beside --run-dir /tmp/tiny --smallest --heldout 8 --eval-interval 1   # a smoke run

`--run-dir` is a miniature run folder whose SFT phase is done (examples/search-r1/run_miniature_cpu.sh with the same
SEED, POLICY and TOOL_FORMAT); with --smallest (every phase a few steps on a tiny task, engine_death.SMALLEST) a new
folder will do: the first run makes the phases before RL. Two RL runs start from its SFT weights with the same seed,
evaluated every --eval-interval versions on the task's first --heldout held-out questions: one evaluates inside the step
(the default), one on an engine of its own beside training. Printed per run: wall time of the RL driver (start-up
included), the steps' summed time, the evaluation time that sat in the training loop (inside: every eval; beside: the
weight hand-over and the final wait), and each evaluated version's EM. Everything runs on this machine's cores, so the
eval engine beside training competes with the training engine and the actor for them: the figure is what evaluation
beside training gives where there is no spare hardware, the least it gives.

Its figures: `docs/benchmarks/eval.md`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.paths import MINIATURE_SCRIPT as SCRIPT

TASK_SIZE = {"people": 800, "companies": 200}  # the run script's PEOPLE and COMPANIES


def smallest_task_size() -> dict[str, int]:
    from benchmarks.harness.miniature_runs import SMALLEST

    return {"people": int(SMALLEST["PEOPLE"]), "companies": int(SMALLEST["COMPANIES"])}


def heldout_file(run_dir: Path, seed: int, questions: int, template: str, size: dict[str, int] = TASK_SIZE) -> Path:
    """The task's first `questions` held-out questions (the run script keeps 64 for its own evals); `size` must be the
    run folder's task size."""
    from slime_search.miniature.task import make_task, write_task

    out = run_dir / f"task-heldout{questions}"
    if not (out / "heldout.parquet").is_file():
        write_task(make_task(seed, size["people"], size["companies"]), out, questions, template)
    return out / "heldout.parquet"


def run_rl(
    run_dir: Path, name: str, seed: int, heldout: Path, interval: int, beside: bool, env: dict, smallest: bool
) -> float:
    """One RL run of the run script from the SFT weights; returns its wall time (the phases before are skipped)."""
    from benchmarks.harness.miniature_runs import script_env

    rl_args = f"--eval-prompt-data heldout {heldout}" + (" --eval-engine" if beside else "")
    run_env = script_env(run_dir, smallest, **env, SEED=str(seed), RL_NAME=name)
    run_env.update(RL_ARGS=rl_args, EVAL_INTERVAL=str(interval))
    log = run_dir / f"{name}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run(["bash", str(SCRIPT)], env=run_env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}); see {log}")
    return time.perf_counter() - started


def summary(run: Path, wall_s: float) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r]
    evals = [r for r in records if "eval/em" in r]
    beside = any("eval/lag_steps" in r for r in evals)
    in_loop = sum(r.get("time/eval_handover_s", 0.0) for r in steps) if beside else sum(r["time/eval_s"] for r in evals)
    return {
        "wall_s": wall_s,
        "steps_s": sum(r["time/step_s"] for r in steps),
        "step_mean_s": sum(r["time/step_s"] for r in steps) / len(steps),
        "eval_in_loop_s": in_loop,
        "eval_s": sum(r["time/eval_s"] for r in evals),
        "evals": [(r["step"], r["eval/em"], r.get("eval/lag_steps")) for r in evals],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="a miniature run folder whose SFT phase is done")
    parser.add_argument("--seed", type=int, default=0, help="the run folder's SEED")
    parser.add_argument("--heldout", type=int, default=600, help="held-out questions per evaluation")
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--policy", default="qwen2", help="the run folder's POLICY")
    parser.add_argument("--tool-format", default="tags", help="the run folder's TOOL_FORMAT")
    parser.add_argument("--smallest", action="store_true", help="a smoke run: every phase a few steps, a tiny task")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    if not args.smallest and not (run_dir / ".done-sft").is_file():
        parser.error(f"{run_dir} has no finished SFT phase: run examples/search-r1/run_miniature_cpu.sh first")
    run_dir.mkdir(parents=True, exist_ok=True)
    template = "native" if args.tool_format == "qwen3" else "base"
    size = smallest_task_size() if args.smallest else TASK_SIZE
    heldout = heldout_file(run_dir, args.seed, args.heldout, template, size)
    env = {"POLICY": args.policy, "TOOL_FORMAT": args.tool_format}
    results = {}
    for where in ("inside", "beside"):
        name = f"rl-eval-{where}-h{args.heldout}-i{args.eval_interval}"
        wall = run_rl(run_dir, name, args.seed, heldout, args.eval_interval, where == "beside", env, args.smallest)
        results[where] = summary(run_dir / name, wall)
        print(f"{where}: {json.dumps(results[where])}", file=sys.stderr)
    print("| eval | RL wall time | sum of step times | mean step | eval time in the loop | eval time (all) |")
    print("|---|---|---|---|---|---|")
    for where, r in results.items():
        print(
            f"| {where} | {r['wall_s']:.1f} s | {r['steps_s']:.1f} s | {r['step_mean_s']:.2f} s | "
            f"{r['eval_in_loop_s']:.1f} s | {r['eval_s']:.1f} s |"
        )
    for where, r in results.items():
        shown = ", ".join(f"v{v} {em:.3f}" + (f" (+{lag})" if lag is not None else "") for v, em, lag in r["evals"])
        print(f"{where} held-out EM by version (steps late): {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
