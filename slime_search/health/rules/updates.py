"""Updates the optimizer refused, and the bound it refuses above.

An update is computed but not applied when its gradient norm is not finite, or above --health-grad-spike x the median
of the recent applied ones (decided inside the optimizer step, against `skip_above`). A step none of whose updates was
applied learned nothing: it counts as a skipped step. Refused updates in a row at one level (within the spike factor
of each other) are a lasting change of level, not a spike. GRPO's gradient grows with the share of groups whose
rewards differ, and that share can rise tenfold early in a run. The bound then follows the new level instead of
refusing every step until the run stops.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import Event
from slime_search.health.records import num, recent_median, was_applied

LEVEL_SHIFT_REFUSALS = 2  # refused updates in a row at one gradient-norm level: a new level, not a spike


def refused_whole_step(metrics: dict[str, Any]) -> bool:
    """A step that ran updates and applied none of them."""
    return bool(num(metrics, "train/steps")) and num(metrics, "train/steps_applied") == 0.0


class UpdateRefusals:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.refused: list[tuple[int, float]] = []  # (step, gradient norm) of the current run of refused updates
        self.level: tuple[int, set[int]] | None = None  # a gradient-norm level the baseline follows: (from, refused)

    def refusals(self, step: int, metrics: dict[str, Any], skip: Callable[..., Event]) -> list[Event]:
        """The step's refused updates; a step with none applied is a skip (`skip` makes the last allowed a stop)."""
        steps, applied = num(metrics, "train/steps"), num(metrics, "train/steps_applied")
        if steps is None or applied is None or applied >= steps:
            return []
        norm = num(metrics, "train/grad_norm_max")
        rule = "grad_spike" if norm is not None else "nonfinite_gradient"
        shown = norm if norm is not None else metrics.get("train/grad_norm_max")
        message = f"step {step}: {steps - applied:.0f} of {steps:.0f} updates not applied (gradient norm {shown})"
        values = {"grad_norm": norm if norm is not None else -1.0, "refused": steps - applied}
        if applied == 0:
            skipped = skip(step, rule, message, values)
            return [skipped if skipped.action == "stop" else Event(step, "refuse", rule, message, values)]
        return [Event(step, "refuse", rule, message, values)]

    def skip_above(self, history: list[dict[str, Any]]) -> float | None:
        """The gradient norm above which an update is refused, or None.

        It is --health-grad-spike x the median of the recent applied steps' norms, None until there are
        `spike_baseline_steps` of them. Or it is --health-grad-spike x the median of a new level's refused norms."""
        spike = self.config.grad_spike
        norms = [norm for _, norm in self.refused]
        if len(norms) >= LEVEL_SHIFT_REFUSALS and max(norms) <= spike * min(norms):
            return spike * statistics.median(norms)
        records = history if self.level is None else [r for r in history if r["step"] >= self.level[0]]
        median = recent_median(
            records, "train/grad_norm", self.config.window, self._counts_for_norm, self.config.spike_baseline_steps
        )
        return None if median is None else spike * median

    def _counts_for_norm(self, record: dict[str, Any]) -> bool:
        return was_applied(record) or (self.level is not None and record["step"] in self.level[1])

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Track refused updates in a row; an update applied after a run of them at one level makes that level the
        gradient-norm baseline's."""
        norm, refused = num(metrics, "train/grad_norm_max"), refused_whole_step(metrics)
        applied = bool(num(metrics, "train/steps_applied"))
        if refused and norm is not None:
            self.refused.append((step, norm))
            return
        if applied and len(self.refused) >= LEVEL_SHIFT_REFUSALS:
            self.level = (self.refused[0][0], {s for s, _ in self.refused})
        if applied or refused:
            self.refused = []

    def forget_from(self, step: int) -> None:
        self.refused = []
        if self.level is not None and self.level[0] >= step:
            self.level = None
