"""What one engine death costs a run: the miniature's GRPO phase with two CPU engines, once undisturbed and once with
one engine SIGKILLed after a given step; per-step wall times, the step that absorbed the death, failovers, restarts.

    python -m benchmarks.studies.engine_death --run-dir runs/miniature --kill-after-step 5
    python -m benchmarks.studies.engine_death --run-dir /tmp/tiny --kill-after-step 1 --smallest     # a smoke run

RUN_DIR should hold a miniature whose task, policy, index and SFT phases are done
(examples/search-r1/run_miniature_cpu.sh skips them when rerun on it; in a new folder the first run makes them); the two
RL runs go to RUN_DIR/rl-2engines and RUN_DIR/rl-2engines-kill. --smallest shrinks every phase to a few steps on a tiny
task (SMALLEST). The engine killed is one of the CPU engine servers this benchmark's own run started (found among its
descendants by PID). Prints a markdown table (docs/benchmarks/engine_faults.md records it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.miniature_runs import records, script_env
from benchmarks.harness.paths import MINIATURE_SCRIPT as SCRIPT


def cpu_engines(pid: int) -> list:
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    engines = []
    for child in children:
        try:
            if "slime_search.engines.cpu_engine_server" in " ".join(child.cmdline()):
                engines.append(child)
        except psutil.NoSuchProcess:  # ended since it was listed (a zombie included): not an engine to kill
            continue
    return engines


def run_rl(run_dir: Path, name: str, kill_after: int | None, smallest: bool = False) -> tuple[Path, float | None]:
    """The RL phase with two engines; with `kill_after`, one engine is killed once that step is logged. Returns the
    run folder and when the kill happened (seconds since the run started)."""
    env = script_env(run_dir, smallest, RL_NAME=name, RL_ARGS="--cpu-engines 2")
    run = run_dir / name
    started = time.monotonic()
    killed_at = None
    with open(run_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if kill_after is not None and killed_at is None:
                done = [r for r in records(run) if "train/loss" in r and r["step"] >= kill_after]
                engines = cpu_engines(proc.pid)
                if done and len(engines) == 2:
                    os.kill(engines[1].pid, signal.SIGKILL)
                    killed_at = time.monotonic() - started
            time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"the RL run failed: see {run_dir / f'{name}.log'}")
    return run, killed_at


def summary(run: Path) -> dict:
    train = [r for r in records(run) if "train/loss" in r]
    evals = [r for r in records(run) if "eval/em" in r]
    times = sorted(r["time/step_s"] for r in train)
    restarted = [r for r in train if r.get("engines/restarted")]
    return {
        "steps": len(train),
        "median_step_s": times[len(times) // 2],
        "total_step_s": sum(times),
        "failovers": sum(r.get("rollout/engine_failovers", 0.0) for r in train),
        "engine_errors": sum(r.get("rollout/engine_errors", 0.0) for r in train),
        "restarts": sum(r.get("engines/restarted", 0.0) for r in train),
        "death_steps": [
            {k: round(r.get(k, 0.0), 3) for k in ("step", "time/step_s", "time/rollout_s", "time/engine_check_s")}
            | {"restart_wait_s": round(r.get("time/engine_restart_wait_s", 0.0), 3)}
            for r in train
            if r.get("rollout/engine_failovers") or r.get("engines/restarted")
        ],
        "restart_wait_s": sum(r.get("time/engine_restart_wait_s", 0.0) for r in restarted),
        "em": [round(r["eval/em"], 3) for r in evals],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--kill-after-step", type=int, default=5)
    parser.add_argument("--smallest", action="store_true", help="a smoke run: every phase a few steps (SMALLEST)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base, _ = run_rl(run_dir, "rl-2engines", None, args.smallest)
    disturbed, killed_at = run_rl(run_dir, "rl-2engines-kill", args.kill_after_step, args.smallest)
    results = {"undisturbed": summary(base), "one engine killed": summary(disturbed), "killed_at_s": killed_at}
    print(json.dumps(results, indent=1))
    a, b = results["undisturbed"], results["one engine killed"]
    print(
        "| run | steps | median step (s) | sum of step times (s) | failovers | lost trajectories | restarts | held-out EM |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in (("undisturbed", a), ("one engine killed", b)):
        print(
            f"| {name} | {r['steps']} | {r['median_step_s']:.2f} | {r['total_step_s']:.1f} | {r['failovers']:.0f} | "
            f"{r['engine_errors']:.0f} | {r['restarts']:.0f} | {' / '.join(map(str, r['em']))} |"
        )
    print(f"cost of the death: {b['total_step_s'] - a['total_step_s']:+.1f} s of step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
