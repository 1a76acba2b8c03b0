"""Runs of the CPU miniature's script (examples/search-r1/run_miniature_cpu.sh) and what each left in its folder: the
harness the studies share for runs over seeds x modes x replicas.

A run folder holds `metrics.jsonl` (one record per step and per evaluation), `health.jsonl` (the guard's events) and
`weights/step_N` (HF weights of the kept checkpoints); a study's run is named for its mode, learning rate and replica.
"""

from __future__ import annotations

import os
from pathlib import Path

from slime_search.utils.records import read_records

WIDE_EVAL = "wide_eval.json"  # in each run's folder: its final weights' metrics on all held-out questions
# The run script's settings for a smoke run: every phase runs, a few steps each, on a tiny task.
SMALLEST = {
    "PEOPLE": "40",
    "COMPANIES": "12",
    "HELDOUT": "8",
    "PRETRAIN_STEPS": "2",
    "SFT_STEPS": "2",
    "SFT_BATCH": "4",
    "RL_STEPS": "3",
    "RL_PROMPTS": "2",
    "RL_SAMPLES": "2",
    "EVAL_INTERVAL": "3",
}


def script_env(run_dir: Path, smallest: bool, **settings: str) -> dict[str, str]:
    """The run script's environment: this one's, free ports for its retriever and demonstrator unless given (two runs
    on one machine must not meet on the script's fixed defaults), SMALLEST with `smallest`, then `settings`."""
    from slime_search.utils.net import free_port

    env = {**os.environ, "RUN_DIR": str(run_dir), **(SMALLEST if smallest else {}), **settings}
    for name in ("RETRIEVER_PORT", "DEMO_PORT"):
        env.setdefault(name, str(free_port()))
    return env


def records(run: Path) -> list[dict]:
    """The run's metrics records (none before its first step)."""
    return read_records(run / "metrics.jsonl")


def run_name(mode: str, lr: str | None, replica: int = 0) -> str:
    return f"rl-{mode}" + (f"-lr{lr}" if lr else "") + (f"-rep{replica}" if replica else "")


def replica_seed(seed: int, replica: int) -> int:
    """The sampling and prompt-order seed of a replica: replica 0 is the seed's own run."""
    return seed + 1000 * replica


def run_flags(mode: str, max_staleness: int, seed: int, replica: int, extra: str = "") -> str:
    """train.py flags of one run (RL_ARGS); a replica > 0 samples and orders prompts with a seed of its own; `extra`
    (e.g. "--save-interval 2", the checkpoints a health rollback returns to) is passed to every run."""
    flags = f"--async-mode {mode}" + (f" --max-staleness {max_staleness}" if mode == "fully" else "")
    if replica:
        flags += f" --seed {replica_seed(seed, replica)} --rollout-seed {replica_seed(seed, replica)}"
    return f"{flags} {extra}".strip()


def health_events(run: Path) -> list[dict]:
    """The guard's events of the run (none when it raised none)."""
    return read_records(run / "health.jsonl")


def stopped(run: Path) -> bool:
    """Whether the health guard stopped the run (a result to report, not a failure of the benchmark)."""
    return any(e.get("action") == "stop" for e in health_events(run))


def ended_on_best(run: Path) -> int | None:
    """The step of the checkpoint a run ended on after a late decline (the guard's end_on_best), if it did."""
    ends = [e for e in health_events(run) if e.get("action") == "end_on_best"]
    return int(ends[-1]["values"]["ended_on"]) if ends else None


def final_weights(run: Path) -> Path:
    """The run's last saved HF weights: step_<steps> for a run that finished, the last kept one for a stopped run."""
    saved = sorted((run / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not saved:
        raise FileNotFoundError(f"{run}: no weights/step_* to evaluate")
    return saved[-1]


def health_summary(run: Path) -> dict[str, float]:
    """What the health guard did in a run: its rollbacks, warnings, watched held-out falls and whether it stopped the
    run."""
    from slime_search.health.verdict import completed_rollbacks

    events = health_events(run)
    return {
        "rollbacks": len(completed_rollbacks(events)),  # one per checkpoint gone back to, not per logged line
        "warnings": sum(e.get("action") == "warn" for e in events),
        "watches": sum(e.get("action") == "watch" for e in events),
        "stopped": float(stopped(run)),
        "ended_on_best": float(ended_on_best(run) if ended_on_best(run) is not None else -1),
    }


def signed(difference: float) -> str:
    """A difference to three decimals, with no "-0.000" for one that is zero but for float rounding."""
    return f"{round(difference, 9) + 0.0:+.3f}"


def deepest_dip(curve: list[float]) -> float:
    """The largest fall of the held-out EM below its best so far (0 for a curve that never fell)."""
    best, dip = float("-inf"), 0.0
    for em in curve:
        best = max(best, em)
        dip = max(dip, best - em)
    return dip
