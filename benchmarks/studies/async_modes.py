"""Learning under asynchronous training, measured on the CPU miniature: the same SFT start per seed, then GRPO with
--async-mode off, one-step and fully; held-out EM per run and its difference from the synchronous run of the seed.

    python -m benchmarks.studies.async_modes --out runs/async --seeds 0 1 2 --max-staleness 2 [--rl-lr 5e-4] \
        [--wide-eval [--replicas 5]] [--modes one-step fully]

Each seed's task, policy, index and SFT checkpoint are made once (examples/search-r1/run_miniature_cpu.sh skips the
phases a run folder already holds); each mode is an RL run of its own from those weights (RUN/seedS/rl-MODE). A run
already complete is read, not repeated. Prints a markdown table (docs/benchmarks/async.md records it).

The runs' own evals use the task's first 64 held-out questions; one eval's standard error is ~0.04. With --wide-eval it
also evaluates each run's final weights, greedy, on every held-out question of the task (600: standard error ~0.012).
With --replicas N it repeats every run with sampling seeds of its own, from the same SFT weights
(RUN/seedS/rl-MODE-repR). How far two synchronous runs land apart is the yardstick for the modes' gap.

With the health guard (on by default) a run may roll back or stop: --extra-args "--save-interval 2" gives it
checkpoints to return to, and a last table lists every run with the guard's rollbacks, warnings and stops. A run the
guard stopped is a result: its last saved weights are the ones evaluated; a run that ended on its best checkpoint
after a late decline (--health-end-drop) is evaluated on those weights. --extra-args "--no-health-guard" gives the
same runs unguarded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.miniature_runs import (
    WIDE_EVAL,
    deepest_dip,
    ended_on_best,
    final_weights,
    health_summary,
    records,
    run_flags,
    run_name,
    signed,
    stopped,
)
from benchmarks.harness.paths import MINIATURE_SCRIPT as SCRIPT
from slime_search.utils.net import free_port

MODES = ("off", "one-step", "fully")
TASK_SIZE = {"people": 800, "companies": 200}  # the run script's PEOPLE and COMPANIES
EVAL_FLAGS = [  # the run script's search settings: the final weights are evaluated as the runs' own evals are
    "--search-topk", "1", "--max-turns", "2", "--max-obs-tokens", "96", "--max-response-tokens", "192",
    "--rollout-max-response-len", "48", "--apply-chat-template", "--tool-format", "tags",
    "--custom-generate-function-path", "slime_search.search_r1.generate.generate",
    "--custom-rm-path", "slime_search.search_r1.reward.reward_func",
]  # fmt: skip


def complete(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps and "eval/em" in r for r in records(run))


def run_mode(
    out: Path,
    seed: int,
    mode: str,
    max_staleness: int,
    steps: int,
    lr: str | None = None,
    replica: int = 0,
    extra: str = "",
    eval_interval: int | None = None,
) -> Path:
    """One GRPO run from the seed's SFT weights (read, not repeated, when already complete or stopped by the
    health guard)."""
    name = run_name(mode, lr, replica)
    run = out / f"seed{seed}" / name
    if complete(run, steps) or stopped(run):
        return run
    env = {
        **os.environ,
        "RUN_DIR": str(out / f"seed{seed}"),
        "SEED": str(seed),
        "RL_NAME": name,
        "RL_ARGS": run_flags(mode, max_staleness, seed, replica, extra),
        "RL_STEPS": str(steps),
        **({"RL_LR": lr} if lr else {}),
        **({"EVAL_INTERVAL": str(eval_interval)} if eval_interval else {}),
    }
    for port in ("RETRIEVER_PORT", "DEMO_PORT"):  # two benchmarks on one machine must not meet on the defaults
        env.setdefault(port, str(free_port()))
    log = out / f"seed{seed}" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        done = subprocess.run(["bash", str(SCRIPT)], env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0 and not stopped(run):
        raise RuntimeError(f"{name} of seed {seed} failed (exit {done.returncode}): see {log}")
    return run


def write_all_heldout(seed_dir: Path, seed: int) -> Path:
    """Every held-out question of the seed's task (the run script keeps its first 64), as a parquet file."""
    from slime_search.miniature.task import make_task, write_task

    out = seed_dir / "task-all-heldout"
    if not (out / "heldout.parquet").is_file():
        write_task(make_task(seed, TASK_SIZE["people"], TASK_SIZE["companies"]), out)
    return out / "heldout.parquet"


def eval_arguments(run: Path, steps: int, heldout: Path, search_url: str) -> list[str]:
    """`slime_search.eval`'s arguments for the run's final weights on `heldout`, written to RUN/WIDE_EVAL."""
    best = ended_on_best(run)
    if best is not None:
        weights = run / "weights" / f"step_{best}"
    else:
        weights = run / "weights" / f"step_{steps}" if not stopped(run) else final_weights(run)
    return [
        "--hf-checkpoint", str(weights), "--eval-prompt-data", "heldout", str(heldout),
        "--search-url", search_url, "--output", str(run / WIDE_EVAL), *EVAL_FLAGS,
    ]  # fmt: skip


def wide_eval(run: Path, steps: int, heldout: Path, search_url: str) -> dict[str, float]:
    """The run's final weights evaluated greedily on `heldout` (once: the metrics are kept in RUN/WIDE_EVAL)."""
    out = run / WIDE_EVAL
    if not out.is_file():
        command = [sys.executable, "-m", "slime_search.eval", *eval_arguments(run, steps, heldout, search_url)]
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=True)
    metrics = json.loads(out.read_text())
    return {"wide_em": metrics["eval/em"], "wide_n": metrics["eval/n"]}


def wide_evals(out: Path, seed: int, runs: dict[str, Path], steps: int) -> dict[str, dict[str, float]]:
    """wide_eval of each mode's run of one seed, against the seed's own BM25 retriever."""
    from local_dense_retriever.launch import RetrievalServerProcess

    seed_dir = out / f"seed{seed}"
    heldout = write_all_heldout(seed_dir, seed)
    index = ("--retriever-name", "bm25", "--index-path", str(seed_dir / "index" / "bm25"), "--topk", "1")
    with RetrievalServerProcess(*index, "--corpus-path", str(seed_dir / "task" / "corpus.jsonl")) as retriever:
        return {mode: wide_eval(run, steps, heldout, f"{retriever.url}/retrieve") for mode, run in runs.items()}


def standard_error(p: float, n: float) -> float:
    return (p * (1.0 - p) / n) ** 0.5


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
        **health_summary(run),
    }


def table(results: dict[tuple[int, str], dict[str, float]], seeds: list[int], modes: list[str]) -> str:
    wide = all("wide_em" in r for r in results.values())
    lines = [
        "| seed | mode | held-out EM by version | end vs off | mean after start | vs off | search rate end | "
        "mean step s | token lag mean | interrupted trajectories |"
        + (" final EM, all held-out | vs off |" if wide else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if wide else ""),
    ]
    for seed in seeds:
        off = results[(seed, "off")]
        for mode in modes:
            r = results[(seed, mode)]
            line = (
                f"| {seed} | {mode} | {' / '.join(f'{em:.3f}' for em in r['em_curve'])} | "
                f"{signed(r['em_end'] - off['em_end'])} | {r['em_trained_mean']:.3f} | "
                f"{signed(r['em_trained_mean'] - off['em_trained_mean'])} | {r['search_rate_end']:.3f} | "
                f"{r['step_s']:.2f} | {r['staleness_mean']:.2f} | {r['interrupted']:.0f} |"
            )
            if wide:
                se = standard_error(r["wide_em"], r["wide_n"])
                se_diff = (se**2 + standard_error(off["wide_em"], off["wide_n"]) ** 2) ** 0.5
                line += f" {r['wide_em']:.3f} ± {se:.3f} | {signed(r['wide_em'] - off['wide_em'])} ± {se_diff:.3f} |"
            lines.append(line)
    for mode in modes:
        ends = [results[(s, mode)]["em_end"] for s in seeds]
        means = [results[(s, mode)]["em_trained_mean"] for s in seeds]
        line = f"| all seeds | {mode} | | end {sum(ends) / len(ends):.3f} | {sum(means) / len(means):.3f} | | | | | |"
        if wide:
            finals = [results[(s, mode)]["wide_em"] for s in seeds]
            offs = [results[(s, "off")]["wide_em"] for s in seeds]
            line += f" {sum(finals) / len(finals):.3f} | {signed((sum(finals) - sum(offs)) / len(finals))} |"
        lines.append(line)
    return "\n".join(lines)


def replica_table(finals: dict[tuple[int, str, int], float], seeds: list[int], replicas: int, modes: list[str]) -> str:
    """Final EM on all held-out questions of every replica: how far runs of one mode spread against the modes' gap."""
    lines = [
        "| seed | mode | final EM per replica | mean | mean vs off | spread (max - min) |",
        "|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        off = sum(finals[(seed, "off", r)] for r in range(replicas)) / replicas
        for mode in modes:
            ems = [finals[(seed, mode, r)] for r in range(replicas)]
            mean = sum(ems) / replicas
            lines.append(
                f"| {seed} | {mode} | {' / '.join(f'{em:.3f}' for em in ems)} | {mean:.3f} | {signed(mean - off)} | "
                f"{max(ems) - min(ems):.3f} |"
            )
    for mode in modes:
        mean = sum(finals[(s, mode, r)] for s in seeds for r in range(replicas)) / (len(seeds) * replicas)
        off = sum(finals[(s, "off", r)] for s in seeds for r in range(replicas)) / (len(seeds) * replicas)
        lines.append(f"| all seeds | {mode} | | {mean:.3f} | {signed(mean - off)} | |")
    return "\n".join(lines)


def health_table(runs: dict[tuple[int, str, int], dict], seeds: list[int], replicas: int, modes: list[str]) -> str:
    """Every run, with what the health guard did in it and where it ended against its seed's synchronous mean."""
    lines = [
        "| seed | mode | replica | final EM, all held-out | vs seed's off mean | deepest dip (64 q) | rollbacks | "
        "warnings | stopped | ended on best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    below = 0
    for seed in seeds:
        off = sum(runs[(seed, "off", r)]["wide_em"] for r in range(replicas)) / replicas
        for mode in modes:
            for replica in range(replicas):
                r = runs[(seed, mode, replica)]
                below += r["wide_em"] < off - 0.05
                best = r.get("ended_on_best", -1)
                ended = "no" if best < 0 else f"step {best:.0f}"
                lines.append(
                    f"| {seed} | {mode} | {replica} | {r['wide_em']:.3f} | {signed(r['wide_em'] - off)} | "
                    f"{deepest_dip(r['em_curve']):.3f} | {r['rollbacks']:.0f} | {r['warnings']:.0f} | "
                    f"{'yes' if r['stopped'] else 'no'} | "
                    f"{ended} |"
                )
    total = len(seeds) * replicas * len(modes)
    lines.append(f"\n{below} of {total} runs ended more than 0.05 below their seed's synchronous mean.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/async")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="off is always run")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rl-lr", default=None, help="GRPO learning rate (default: the run script's RL_LR)")
    parser.add_argument(
        "--wide-eval", action="store_true", help="also evaluate final weights on all held-out questions"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="GRPO runs per seed and mode, each sampling with a seed of its own"
    )
    parser.add_argument("--extra-args", default="", help='train.py flags added to every run, e.g. "--save-interval 2"')
    parser.add_argument(
        "--eval-interval", type=int, default=None, help="versions between held-out evals (the run script's default)"
    )
    parser.add_argument(
        "--twins-only",
        action="store_true",
        help="make only the --modes runs and their wide evals, no synchronous runs and no tables: the unguarded "
        "twins of another folder's runs, which benchmarks.studies.guard_twins compares with them",
    )
    args = parser.parse_args(argv)
    if args.twins_only:
        if "off" in args.modes or not args.wide_eval:
            parser.error("--twins-only makes asynchronous twins: give --modes without off, and --wide-eval")
    else:
        args.modes = ["off", *(mode for mode in args.modes if mode != "off")]  # every mode is compared with off
    if args.replicas > 1 and not args.wide_eval:
        parser.error("--replicas compares final weights on all held-out questions: add --wide-eval")
    out = Path(args.out)
    results, finals, every_run = {}, {}, {}
    for seed in args.seeds:
        for replica in range(args.replicas):
            runs = {
                mode: run_mode(
                    out,
                    seed,
                    mode,
                    args.max_staleness,
                    args.steps,
                    args.rl_lr,
                    replica,
                    args.extra_args,
                    args.eval_interval,
                )
                for mode in args.modes
            }
            wide = wide_evals(out, seed, runs, args.steps) if args.wide_eval else {}
            for mode, run in runs.items():
                result = summary(run) | wide.get(mode, {})
                finals[(seed, mode, replica)] = result.get("wide_em")
                every_run[(seed, mode, replica)] = result
                if replica == 0:
                    results[(seed, mode)] = result
                print(f"seed {seed} {mode} replica {replica}: {json.dumps(result)}", flush=True)
    if args.twins_only:
        return 0
    print(table(results, args.seeds, args.modes))
    if args.replicas > 1:
        print(replica_table(finals, args.seeds, args.replicas, args.modes))
        print(health_table(every_run, args.seeds, args.replicas, args.modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
