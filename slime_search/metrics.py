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
        # wandb's own step only goes forward (a log below the newest is dropped), and the train step does not: a
        # rollback redoes steps, an evaluation beside training arrives late. So every record is a wandb step of its
        # own, and the plots use x-axes of ours: the train step, or for evaluations the version they evaluated.
        self._wandb_step = 0
        self._axes: set[str] = set()  # the keys whose x-axis wandb was told

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        append_records(self.path, [record])
        if self._wandb is not None:
            values = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            self._define_axes(values)
            self._wandb.log(values, step=self._wandb_step)
            self._wandb_step += 1
        shown = " ".join(
            f"{k.split('/')[-1]}={record[k]:.4g}" for k in CONSOLE_KEYS if isinstance(record.get(k), (int, float))
        )
        logger.info("step %d %s", step, shown)

    def _define_axes(self, keys) -> None:
        """Each key's x-axis, told to wandb the first time the key is logged: eval/* against weight_version, the rest
        against the train step. By exact name: wandb picks among matching glob patterns in no fixed order."""
        for key in keys:
            if key in self._axes:
                continue
            self._axes.add(key)
            if key in ("step", "weight_version"):
                self._wandb.define_metric(key)
            else:
                self._wandb.define_metric(key, step_metric="weight_version" if key.startswith("eval/") else "step")

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


def trainer_idle(clock: PhaseClock) -> dict[str, float]:
    """The share of the step the actor neither trained nor pushed weights: it waited for its batch (or engines)."""
    times = clock.times()
    busy = times.get("time/train_s", 0.0) + times.get("time/sync_s", 0.0)
    return {"async/trainer_idle_fraction": 1.0 - busy / times["time/step_s"] if times["time/step_s"] > 0 else 0.0}


def _plain_config(config: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v) for k, v in config.items()}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
