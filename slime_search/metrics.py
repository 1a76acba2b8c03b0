"""One metrics sink per run: a compact console line, a jsonl file, and wandb (offline unless a key is set)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from slime_search.utils.records import append_records, keep_records_before, read_records

logger = logging.getLogger(__name__)

CONSOLE_KEYS = (
    "rollout/reward_mean",
    "eval/em",
    "train/loss",
    "train/grad_norm",
    "rollout/searches_mean",
    "time/step_s",
)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class MetricsSink:
    def __init__(
        self,
        run_dir: str | Path,
        use_wandb: bool = False,
        project: str = "slime-search",
        group: str | None = None,
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._wandb = None
        if use_wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project=project, group=group, dir=str(self.run_dir), mode=mode, config=_plain_config(config or {})
            )
            # evaluations plot against the version they evaluated, which is not the step they are logged at when
            # they run beside training (--eval-engine)
            self._wandb.define_metric("weight_version")
            self._wandb.define_metric("eval/*", step_metric="weight_version")
        self._wandb_step = 0  # wandb's steps only go forward: a late record joins the newest step

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        append_records(self.path, [record])
        if self._wandb is not None:
            self._wandb_step = max(self._wandb_step, step)
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=self._wandb_step)
        shown = " ".join(
            f"{k.split('/')[-1]}={record[k]:.4g}" for k in CONSOLE_KEYS if isinstance(record.get(k), (int, float))
        )
        logger.info("step %d %s", step, shown)

    def read(self) -> list[dict[str, Any]]:
        return read_records(self.path)

    def drop_from(self, step: int) -> int:
        """Forget records of steps >= `step` (a resumed run redoes them); returns how many."""
        return keep_records_before(self.path, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


class PhaseClock:
    """Wall time of consecutive phases of a step: mark("rollout"), mark("train"), ... then times()."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.last
        self.last = now

    def times(self) -> dict[str, float]:
        return {**{f"time/{k}_s": v for k, v in self.phases.items()}, "time/step_s": self.last - self.start}


def _plain_config(config: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v) for k, v in config.items()}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
