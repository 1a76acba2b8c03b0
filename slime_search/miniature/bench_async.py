"""Learning under asynchronous training, measured on the CPU miniature: the same SFT start per seed, then GRPO with
--async-mode off, one-step and fully; held-out EM per run and its difference from the synchronous run of the seed.

    python -m slime_search.miniature.bench_async --out runs/async --seeds 0 1 2 --max-staleness 2 [--rl-lr 5e-4]

Each seed's task, policy, index and SFT checkpoint are made once (examples/search-r1/run_miniature_cpu.sh skips the
phases a run folder already holds); each mode is an RL run of its own from those weights (RUN/seedS/rl-MODE). A run
already complete is read, not repeated. Prints a markdown table (docs/benchmarks/async.md records it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODES = ("off", "one-step", "fully")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "search-r1" / "run_miniature_cpu.sh"


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def complete(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps and "eval/em" in r for r in records(run))


def run_name(mode: str, lr: str | None) -> str:
    return f"rl-{mode}" + (f"-lr{lr}" if lr else "")


def run_mode(out: Path, seed: int, mode: str, max_staleness: int, steps: int, lr: str | None = None) -> Path:
    run = out / f"seed{seed}" / run_name(mode, lr)
    if complete(run, steps):
        return run
    flags = f"--async-mode {mode}" + (f" --max-staleness {max_staleness}" if mode == "fully" else "")
    env = {
        **os.environ,
        "RUN_DIR": str(out / f"seed{seed}"),
        "SEED": str(seed),
        "RL_NAME": run_name(mode, lr),
        "RL_ARGS": flags,
        "RL_STEPS": str(steps),
        **({"RL_LR": lr} if lr else {}),
    }
    log = out / f"seed{seed}" / f"{run_name(mode, lr)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        subprocess.run(["bash", str(SCRIPT)], env=env, stdout=handle, stderr=subprocess.STDOUT, check=True)
    return run


def summary(run: Path) -> dict[str, float]:
    rows = records(run)
    evals = [r for r in rows if "eval/em" in r]
    train = [r for r in rows if "train/loss" in r]
    lag_keys = sorted({k for r in train for k in r if k.startswith("async/staleness_tokens_lag_")})
    trained = [r["eval/em"] for r in evals[1:]]
    return {
        "em_start": evals[0]["eval/em"],
        "em_end": evals[-1]["eval/em"],
        "em_trained_mean": sum(trained) / len(trained),  # every eval after the start: less noisy than the last
        "em_curve": [round(r["eval/em"], 3) for r in evals],
        "search_rate_end": evals[-1]["eval/search_rate"],
        "step_s": sum(r["time/step_s"] for r in train) / len(train),
        "staleness_mean": sum(r.get("async/staleness_tokens_mean", 0.0) for r in train) / len(train),
        "interrupted": sum(r.get("async/interrupted_trajectories", 0.0) for r in train),
        **{k.rsplit("_", 1)[1]: sum(r.get(k, 0.0) for r in train) / len(train) for k in lag_keys},
    }


def table(results: dict[tuple[int, str], dict[str, float]], seeds: list[int]) -> str:
    lines = [
        "| seed | mode | held-out EM by version | end vs off | mean after start | vs off | search rate end | "
        "mean step s | token lag mean | interrupted trajectories |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        off = results[(seed, "off")]
        for mode in MODES:
            r = results[(seed, mode)]
            lines.append(
                f"| {seed} | {mode} | {' / '.join(f'{em:.3f}' for em in r['em_curve'])} | "
                f"{r['em_end'] - off['em_end']:+.3f} | {r['em_trained_mean']:.3f} | "
                f"{r['em_trained_mean'] - off['em_trained_mean']:+.3f} | {r['search_rate_end']:.3f} | "
                f"{r['step_s']:.2f} | {r['staleness_mean']:.2f} | {r['interrupted']:.0f} |"
            )
    for mode in MODES:
        ends = [results[(s, mode)]["em_end"] for s in seeds]
        means = [results[(s, mode)]["em_trained_mean"] for s in seeds]
        lines.append(
            f"| all seeds | {mode} | | end {sum(ends) / len(ends):.3f} | {sum(means) / len(means):.3f} | | | | | |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/async")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rl-lr", default=None, help="GRPO learning rate (default: the script's, 1e-3)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = {}
    for seed in args.seeds:
        for mode in args.modes:
            run = run_mode(out, seed, mode, args.max_staleness, args.steps, args.rl_lr)
            results[(seed, mode)] = summary(run)
            print(f"seed {seed} {mode}: {json.dumps(results[(seed, mode)])}", flush=True)
    if set(args.modes) == set(MODES):
        print(table(results, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
