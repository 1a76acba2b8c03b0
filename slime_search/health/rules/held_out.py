"""A held-out evaluation below the best one: watched, then rolled back when it lasts.

An evaluation falls when it is more than --health-eval-drop x the best evaluation below it. The margin is a share of
the run's own level, so it serves a run at EM 0.4 as it serves one at 0.95. Where the per-question grades of both
versions are known, the fall must also be beyond chance, paired per question (health.heldout).

A first fall is watched: the checkpoint of the last version within the margin is kept, and the run waits. Falls often
recover by the next evaluation; a collapse does not. The run rolls back to before them when the falls in a row number
--health-eval-patience. It also rolls back when two or more falls span --health-eval-patience-steps steps of training.
A dip that lasts that long is no passing one, however far apart the run evaluates.
"""

from __future__ import annotations

from slime_search.health.config import HealthConfig
from slime_search.health.events import BEFORE, Event
from slime_search.health.heldout import paired_drop_is_real
from slime_search.health.policy import Timeline


class HeldOutRule:
    def __init__(self, config: HealthConfig, timeline: Timeline, eval_key: str):
        self.config = config
        self.timeline = timeline
        self.eval_key = eval_key
        self.falls: list[int] = []  # the versions of the falls in a row, up to the last evaluation

    def margin(self, best: float) -> float:
        return self.config.eval_drop * max(best, 0.0)

    def review(self, version: int, value: float, grades: list[float] | None) -> list[Event]:
        """The evaluation of `version` against those before it (not yet in the timeline)."""
        if not self.fell(value, grades):
            self.falls = []
            return []
        self.falls.append(version)
        best = max(v for _, v in self.timeline.evals)
        last_good = self.last_good()
        message = (
            f"{self.eval_key} {value:.3f} at version {version}, {best - value:.3f} below its best {best:.3f} (more "
            f"than --health-eval-drop {self.config.eval_drop} x the best: {self.margin(best):.3f}); version "
            f"{last_good} was the last within it"
        )
        values = {"value": value, "best": best, BEFORE: float(last_good)}
        if self.lasted():
            return [Event(version, "rollback", "eval_drop", message, values)]
        left = self.config.eval_patience - len(self.falls)
        message += (
            "; watching: the checkpoints a rollback would use are kept, and the run rolls back if the next "
            f"{left} evaluation{'s' if left > 1 else ''} stay{'' if left > 1 else 's'} down, or one at version "
            f"{self.falls[0] + self.config.eval_patience_steps} or later does"
        )
        return [Event(version, "watch", "eval_drop", message, values)]

    def lasted(self) -> bool:
        """The falls in a row number --health-eval-patience, or span --health-eval-patience-steps steps (two at
        least)."""
        if len(self.falls) >= self.config.eval_patience:
            return True
        return len(self.falls) >= 2 and self.falls[-1] - self.falls[0] >= self.config.eval_patience_steps

    def fell(self, value: float, grades: list[float] | None) -> bool:
        """Below the best evaluation by more than the margin, and beyond chance when the two pair up."""
        evals = self.timeline.evals
        if not evals:
            return False
        best_value, best_version = max((v, version) for version, v in evals)
        if best_value - value <= self.margin(best_value):
            return False
        real = paired_drop_is_real(self.timeline.grades.get(best_version), grades, len(evals) + 1)
        return real is not False

    def last_good(self) -> int:
        """The newest evaluated version within the margin of the best: what a rollback goes back to before."""
        best = max(v for _, v in self.timeline.evals)
        return max(version for version, v in self.timeline.evals if best - v <= self.margin(best))
