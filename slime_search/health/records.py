"""Reading the run's step records: the finite numbers the guard's rules and the report's panels compare, the steps
whose update was applied, and the moving and starting yardsticks both draw from them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

MIN_NORMS = 3  # applied steps before a gradient-norm spike can be judged


def spike_baseline_steps(window: int, adapters_from_zero: bool) -> int:
    """Applied steps before a gradient-norm spike is judged: MIN_NORMS, or a whole window under LoRA (its B starts at
    zero, and the first norms rise 10-30x while the run is healthy)."""
    return window if adapters_from_zero else MIN_NORMS


def num(metrics: dict[str, Any], key: str) -> float | None:
    """A finite number, or None: a NaN signal compares False with every bound and would silently pass each rule."""
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def was_applied(record: dict[str, Any]) -> bool:
    """A step whose update (one at least) was applied."""
    return (num(record, "train/steps_applied") or 0.0) > 0


def recent_median(
    records: list[dict[str, Any]],
    key: str,
    window: int,
    keep: Callable[[dict[str, Any]], bool] = lambda r: True,
    minimum: int = MIN_NORMS,
) -> float | None:
    """The median of `key`'s finite values in the last `window` of `records` (step records) that `keep` accepts; None
    before `minimum` of them. The guard's moving yardstick (spike and length bounds), and the report's drawing of it."""
    values = [v for r in records[-window:] if keep(r) and (v := num(r, key)) is not None and math.isfinite(v)]
    return statistics.median(values) if len(values) >= minimum else None


def starting_value(records: list[dict[str, Any]], key: str) -> float | None:
    """A signal's value at the run's first step: measured on the rollouts of the policy the run started from, before
    any update. (A median over the first steps would take in a collapse that begins at the first update.)"""
    return next((float(r[key]) for r in records if "time/step_s" in r and num(r, key) is not None), None)
