"""The health guard against its unguarded twins: the asynchronous benchmark (benchmarks.studies.async_modes) made twice,
with the guard and without it (--extra-args "... --no-health-guard"), compared run by run.

    python -m benchmarks.studies.guard_twins --guarded G [G ...] --unguarded U [U ...] --seeds 0 1 2 \
        --modes one-step fully --replicas 5 --rl-lr 5e-4 [--margin 0.05] [--health-... value ...]

G and U are async_modes --out folders (a seed's runs in DIR/seedS; for each seed the first folder that has it is read).
A seed's synchronous mean is the mean final EM, on all its held-out questions, of the guarded folder's off runs: the
yardstick of the issue's targets. Per seed and mode it counts the runs that end more than --margin below it, guarded and
unguarded. It replays the guard over every unguarded run (benchmarks.harness.guard_replay). The guard is a function of
the records, so the replay shows the first rollback it would have made. Each unguarded run is then one of:

    false alarm  the guard would have rolled it back, and it ended within the margin unaided
    needed       the guard would have rolled it back, and it ended below the margin
    ends on best it ended below the margin with no rollback, and the guard would have ended it on its best evaluated
                 checkpoint (--health-end-drop; what that checkpoint scores on all questions is not measured here)
    missed       it ended below the margin, and the guard would have done neither
    quiet        none of these

Asynchronous runs do not replay the same trajectories, so a guarded run and its twin share their configuration and
seeds, not their batches: the comparison is of the two sets, and the replay is the per-run verdict. Guard settings
other than the defaults (`--health-...` flags of the training CLI) replay other bounds over the same unguarded runs.

Its figures: `docs/benchmarks/health.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from benchmarks.harness.guard_replay import replay
from benchmarks.harness.miniature_runs import WIDE_EVAL, deepest_dip, health_summary, records, run_name, signed
from slime_search.health.config import HealthConfig, add_health_arguments, health_config
from slime_search.utils.records import read_records

VERDICTS = ("false alarm", "needed", "ends on best", "missed", "quiet")


def seed_dir(folders: list[Path], seed: int) -> Path:
    for folder in folders:
        if (folder / f"seed{seed}").is_dir():
            return folder / f"seed{seed}"
    raise FileNotFoundError(f"no seed{seed} folder in {', '.join(map(str, folders))}")


def final_em(run: Path) -> float:
    path = run / WIDE_EVAL
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no {WIDE_EVAL} (run benchmarks.studies.async_modes with --wide-eval)")
    return json.loads(path.read_text())["eval/em"]


def verdict(rolled_back: bool, ends_on_best: bool, below: bool) -> str:
    if rolled_back:
        return "needed" if below else "false alarm"
    if below:
        return "ends on best" if ends_on_best else "missed"
    return "quiet"


def unguarded_run(run: Path, off_mean: float, margin: float, config: HealthConfig) -> dict:
    """One unguarded run: where it ended, how deep it dipped on the way, and what the guard would have done."""
    rows = records(run)
    grades = {r["step"]: r["grades"] for r in read_records(run / "eval_grades.jsonl")}
    events = replay(rows, config, grades)
    rollback = next((e for e in events if e.action == "rollback"), None)
    ends_on_best = any(e.action == "end_on_best" for e in events)
    end = final_em(run)
    below = end < off_mean - margin
    return {
        "final": end,
        "below": below,
        "dip": deepest_dip([r["eval/em"] for r in rows if "eval/em" in r and "time/eval_s" in r]),
        "rollback": rollback,
        "rollbacks": sum(e.action == "rollback" for e in events),
        "verdict": verdict(rollback is not None, ends_on_best, below),
    }


def guarded_run(run: Path, off_mean: float, margin: float) -> dict:
    end = final_em(run)
    return {"final": end, "below": end < off_mean - margin, **health_summary(run)}


def compare(
    guarded: list[Path],
    unguarded: list[Path],
    seeds: list[int],
    modes: list[str],
    replicas: int,
    lr: str | None,
    margin: float,
    config: HealthConfig,
) -> dict:
    """Every run of both sets, keyed by (seed, mode, replica), and each seed's synchronous mean."""
    off_means, guarded_runs, unguarded_runs = {}, {}, {}
    for seed in seeds:
        home = seed_dir(guarded, seed)
        offs = [final_em(home / run_name("off", lr, r)) for r in range(replicas)]
        off_means[seed] = sum(offs) / replicas
        twin_home = seed_dir(unguarded, seed)
        for mode in modes:
            for r in range(replicas):
                name = run_name(mode, lr, r)
                guarded_runs[(seed, mode, r)] = guarded_run(home / name, off_means[seed], margin)
                unguarded_runs[(seed, mode, r)] = unguarded_run(twin_home / name, off_means[seed], margin, config)
    return {"off": off_means, "guarded": guarded_runs, "unguarded": unguarded_runs}


def finals(runs: list[dict]) -> str:
    return " / ".join(f"{run['final']:.3f}" for run in runs)


def summary_table(result: dict, seeds: list[int], modes: list[str], replicas: int, margin: float) -> str:
    lines = [
        f"| seed | mode | sync mean | guarded: final EM per replica | below by > {margin} | rollbacks | "
        f"unguarded: final EM per replica | below by > {margin} | guard replayed on the unguarded: "
        f"{' / '.join(VERDICTS)} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        for mode in modes:
            g = [result["guarded"][(seed, mode, r)] for r in range(replicas)]
            u = [result["unguarded"][(seed, mode, r)] for r in range(replicas)]
            counts = Counter(run["verdict"] for run in u)
            lines.append(
                f"| {seed} | {mode} | {result['off'][seed]:.3f} | {finals(g)} | "
                f"{sum(run['below'] for run in g)} | {sum(run['rollbacks'] for run in g):.0f} | "
                f"{finals(u)} | {sum(run['below'] for run in u)} | "
                f"{' / '.join(str(counts[v]) for v in VERDICTS)} |"
            )
    g_all, u_all = result["guarded"].values(), result["unguarded"].values()
    totals = Counter(run["verdict"] for run in u_all)
    lines.append(
        f"| all | | | | {sum(run['below'] for run in g_all)} of {len(g_all)} | "
        f"{sum(run['rollbacks'] for run in g_all):.0f} | | {sum(run['below'] for run in u_all)} of {len(u_all)} | "
        f"{' / '.join(str(totals[v]) for v in VERDICTS)} |"
    )
    return "\n".join(lines)


def twin_table(result: dict, seeds: list[int], modes: list[str], replicas: int) -> str:
    """Every unguarded run, with the guard's replayed first rollback and the verdict on it."""
    lines = [
        "| seed | mode | replica | unguarded final EM | vs sync mean | deepest dip (64 q) | replayed first rollback | "
        "replayed rollbacks | verdict | guarded twin's final EM |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        for mode in modes:
            for r in range(replicas):
                u, g = result["unguarded"][(seed, mode, r)], result["guarded"][(seed, mode, r)]
                first = u["rollback"]
                when = "none" if first is None else f"step {first.step} ({first.rule})"
                lines.append(
                    f"| {seed} | {mode} | {r} | {u['final']:.3f} | {signed(u['final'] - result['off'][seed])} | "
                    f"{u['dip']:.3f} | {when} | {u['rollbacks']} | {u['verdict']} | {g['final']:.3f} |"
                )
    return "\n".join(lines)


def false_alarm_rules(result: dict) -> str:
    """Which rule made each false alarm's first rollback: the bound to look at."""
    rules = Counter(run["rollback"].rule for run in result["unguarded"].values() if run["verdict"] == "false alarm")
    return ", ".join(f"{rule} {n}" for rule, n in rules.most_common()) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guarded", type=Path, nargs="+", required=True)
    parser.add_argument("--unguarded", type=Path, nargs="+", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=("off", "one-step", "fully"), default=["one-step", "fully"])
    parser.add_argument("--replicas", type=int, default=5)
    parser.add_argument("--rl-lr", default=None, help="the runs' learning rate as their folders name it")
    parser.add_argument("--margin", type=float, default=0.05, help="how far below the synchronous mean counts")
    add_health_arguments(parser)
    args = parser.parse_args(argv)
    config = health_config(args)
    result = compare(
        args.guarded, args.unguarded, args.seeds, args.modes, args.replicas, args.rl_lr, args.margin, config
    )
    print(summary_table(result, args.seeds, args.modes, args.replicas, args.margin))
    print()
    print(twin_table(result, args.seeds, args.modes, args.replicas))
    print(f"\nFirst rollback of each false alarm, by rule: {false_alarm_rules(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
