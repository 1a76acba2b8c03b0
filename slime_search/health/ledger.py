"""The rollbacks a run has done: where each was decided and the checkpoint it went back to, over the run's life.

Two things are read from it. The first is the budget: --max-rollbacks within the last --health-rollback-window steps
(all of them with a window of 0). So a false alarm early in a week-long run does not use the budget up or halve the
learning rate for good; health.remedy counts the same recent rollbacks. The second is the targets of those recent
rollbacks. The trouble came back from there with the remedy applied, so a new rollback passes over them to the kept
checkpoint before. Pruning must therefore keep that one too (`anchors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RollbackLedger:
    max_rollbacks: int
    window: int  # --health-rollback-window: steps a rollback counts (0: the whole run)
    steps: list[int] = field(default_factory=list)  # the step of every rollback done, in order
    targets: list[int] = field(default_factory=list)  # the checkpoint each of them went back to, in the same order

    def __len__(self) -> int:
        return len(self.steps)

    def record(self, to_step: int, at_step: int) -> None:
        self.steps.append(at_step)
        self.targets.append(to_step)

    def recent(self, step: int) -> int:
        """Rollbacks within the window before `step`."""
        return sum(1 for at in self.steps if self._counts(at, step))

    def left(self, step: int) -> bool:
        return self.recent(step) < self.max_rollbacks

    def recent_targets(self, step: int) -> set[int]:
        """The targets of the rollbacks that still count against the budget at `step`."""
        return {to for at, to in zip(self.steps, self.targets, strict=False) if self._counts(at, step)}

    def anchors(self, step: int) -> list[int]:
        """A rollback that would go back to a recent target goes to the checkpoint before it: the points before which
        those lie (RollbackPolicy.needed keeps their targets)."""
        return [to - 1 for to in self.recent_targets(step) if to > 0]

    def restarts(self) -> list[int]:
        """The steps the current timeline went on from after a rollback, in order: every target that no later
        rollback went back before (one that did undid what had followed it)."""
        out: list[int] = []
        for to in reversed(self.targets):
            if not out or to < out[-1]:
                out.append(to)
        return out[::-1]

    def _counts(self, at: int, step: int) -> bool:
        return not self.window or at > step - self.window
