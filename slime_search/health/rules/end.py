"""At the end of the run: whether to end on the best evaluated checkpoint instead of the last weights.

The final version's held-out evaluation is compared with the best one of a kept checkpoint. If it is more than
--health-end-drop below it, beyond chance, the run ends on that checkpoint: a late decline, too small or too late for
a rollback. Chance is judged paired per question, with the best chosen among all the evaluations. Without grades, the
final evaluation's interval must lie below the best. A fall the evaluations cannot settle is an `end_candidate`. The
run may check it on questions the evaluations left out (`end_on_confirmed`).

Only the final version's own evaluation counts. With evaluations beside training, the last one to arrive may be of an
older version: the final one failed, or evaluation stopped after its failures. Its score says nothing of the final
weights, so the run then ends on its last weights, and says so.
"""

from __future__ import annotations

import logging

from slime_search.health.config import HealthConfig
from slime_search.health.events import Event
from slime_search.health.heldout import paired_drop_is_real
from slime_search.health.policy import RollbackPolicy, Timeline

logger = logging.getLogger(__name__)


class EndRule:
    def __init__(self, config: HealthConfig, timeline: Timeline, policy: RollbackPolicy, eval_key: str):
        self.config = config
        self.timeline = timeline
        self.policy = policy
        self.eval_key = eval_key

    def final_version(self) -> int | None:
        """The weights the run ends with: the last step reviewed + 1 (without one, evaluations alone: the newest)."""
        if self.timeline.history:
            return self.timeline.last_step() + 1
        return self.timeline.evals[-1][0] if self.timeline.evals else None

    def final_evaluation(self, final_version: int) -> float | None:
        """The held-out metric of the final version's own evaluation (the newest of several), None without one."""
        return next((value for version, value in reversed(self.timeline.evals) if version == final_version), None)

    def candidate(self, checkpoints: list[int], final_version: int | None = None) -> tuple[int, float] | None:
        """(version, value) of the best evaluated kept checkpoint, when the final version's evaluation is more than
        --health-end-drop below it."""
        final_version = self.final_version() if final_version is None else final_version
        if not self.config.enabled or not self.config.end_drop or final_version is None:
            return None
        final = self.final_evaluation(final_version)
        best = self.policy.best_evaluated(checkpoints)
        if final is None or best is None or best[0] == final_version or best[1] - final <= self.config.end_drop:
            return None
        return best

    def on_best(self, checkpoints: list[int], final_version: int | None = None) -> Event | None:
        """The event to end on the best evaluated checkpoint, when the fall is beyond chance on the evaluations."""
        final_version = self.final_version() if final_version is None else final_version
        if final_version is None:
            return None
        if self.config.enabled and self.config.end_drop and self.timeline.evals:
            self._say_if_unevaluated(final_version)
        best = self.candidate(checkpoints, final_version)
        if best is None:
            return None
        (version, value), final, grades = best, self.final_evaluation(final_version), self.timeline.grades
        paired = paired_drop_is_real(grades.get(version), grades.get(final_version), len(self.timeline.evals))
        high = self.timeline.eval_highs.get(final_version)
        if paired is False or (paired is None and (high is None or high >= value)):
            return None
        beyond = "beyond chance, paired per question" if paired else f"interval up to {high:.3f}"
        message = (
            f"{self.eval_key} {final:.3f} at the final version {final_version} ({beyond}) is "
            f"{value - final:.3f} below {value:.3f} at version {version} (--health-end-drop {self.config.end_drop}): "
            f"the run ends on the checkpoint of step {version}"
        )
        values = {"value": final, "best": value, "ended_on": float(version)}
        if high is not None:
            values["high"] = high
        return Event(final_version, "end_on_best", "late_decline", message, values)

    def on_confirmed(
        self, version: int, best: list[float], final: list[float], final_version: int | None = None
    ) -> Event | None:
        """The candidate the evaluations could not settle, checked on questions they did not grade: the run ends on
        checkpoint `version` only if its grades (`best`) beat the final weights' beyond chance, one paired test."""
        final_version = self.final_version() if final_version is None else final_version
        final_value = None if final_version is None else self.final_evaluation(final_version)
        if final_value is None or paired_drop_is_real(best, final, 1) is not True:
            return None
        value = dict(self.timeline.evals)[version]
        on_best, on_final = sum(best) / len(best), sum(final) / len(final)
        message = (
            f"{self.eval_key} {final_value:.3f} at the final version {final_version} is {value - final_value:.3f} "
            f"below {value:.3f} at version {version} (--health-end-drop {self.config.end_drop}), and on {len(best)} "
            f"questions the evaluations did not grade {on_final:.3f} against {on_best:.3f} (beyond chance, paired per "
            "question): "
            f"the run ends on the checkpoint of step {version}"
        )
        values = {"value": final_value, "best": value, "ended_on": float(version), "fresh_final": on_final}
        return Event(final_version, "end_on_best", "late_decline", message, {**values, "fresh_best": on_best})

    def _say_if_unevaluated(self, final_version: int) -> None:
        if self.final_evaluation(final_version) is not None:
            return
        last = self.timeline.evals[-1][0]
        logger.warning(
            "health: the final version %d has no held-out evaluation (the last one graded version %d): the run ends "
            "on its last weights, not compared with its best checkpoint (python -m slime_search.eval evaluates them)",
            final_version,
            last,
        )
