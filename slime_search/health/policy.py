"""Which checkpoint a rollback, a stop or the end of a run goes to, and so which checkpoints pruning must keep.

One policy answers both questions. `target` and `stop_target` are where a rule sends the run. `needed` is the set of
those answers for every point a rule could still roll back to before (the guard's `rollback_anchors`). Pruning keeps
`needed`, so a rollback never finds its target pruned.

A checkpoint of `k` steps becomes a rollback target in one of two ways. Either the step that made it and the
--health-confirm-steps steps after it raised nothing that vetoes confirmation (a warning that changed, a refused
update, a skip). Or the held-out set vouched for its weights: version `k` scored above every held-out evaluation before
it. A warning near a checkpoint is a doubt about the steps. The best held-out score yet is evidence about the weights
themselves. Without it, an asynchronous run's early log-prob gap warnings sent a held-out rollback to step 0, past a
version that scored well. Checkpoint 0, the weights the run started from, is the user's choice and trusted as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    """What the guard has seen of the current timeline; a rollback forgets what it undid."""

    history: list[dict[str, Any]] = field(default_factory=list)  # step records, in order
    troubled: set[int] = field(default_factory=set)  # steps that veto the confirmation of a checkpoint
    evals: list[tuple[int, float]] = field(default_factory=list)  # (version, held-out metric), in review order
    eval_highs: dict[int, float] = field(default_factory=dict)  # version -> its metric's interval's upper bound
    grades: dict[int, list[float]] = field(default_factory=dict)  # version -> its per-question grades

    def last_step(self) -> int:
        return self.history[-1]["step"] if self.history else -1

    def first_step(self, default: int) -> int:
        return self.history[0]["step"] if self.history else default

    def record_eval(self, version: int, value: float, grades: list[float] | None, high: float | None) -> None:
        """A held-out evaluation of `version`: its metric, its per-question grades and its interval's upper bound."""
        self.evals.append((version, value))
        if grades is not None:
            self.grades[version] = list(grades)
        if high is not None:
            self.eval_highs[version] = high

    def forget_from(self, step: int) -> None:
        self.history = [r for r in self.history if r["step"] < step]
        self.troubled = {s for s in self.troubled if s < step}
        self.evals = [(version, value) for version, value in self.evals if version < step]
        self.eval_highs = {version: high for version, high in self.eval_highs.items() if version < step}
        self.grades = {version: grades for version, grades in self.grades.items() if version < step}


class RollbackPolicy:
    def __init__(self, confirm_steps: int, timeline: Timeline):
        self.confirm_steps = confirm_steps
        self.timeline = timeline

    def target(
        self, checkpoints: list[int], before: int, passed_over: frozenset[int] | set[int] = frozenset()
    ) -> int | None:
        """The newest of `checkpoints` (steps done) at or before `before` that is confirmed (the step that produced
        it and the --health-confirm-steps steps after it stayed clean) or vouched for by the held-out set. A target in
        `passed_over` (where a recent rollback went and the trouble came back from: the same weights and steps lead to
        it again; a length blow-up came back step for step twice and stopped a run) gives way to the one before it,
        when one qualifies."""
        target = self._newest_good(checkpoints, before)
        while target is not None and target > 0 and target in passed_over:
            earlier = self._newest_good(checkpoints, target - 1)
            if earlier is None:
                break
            target = earlier
        return target

    def _newest_good(self, checkpoints: list[int], before: int) -> int | None:
        last = self.timeline.last_step()
        vouched = self.vouched()
        for k in sorted(checkpoints, reverse=True):
            if k == 0 and before >= 0:
                return 0
            if k > before:
                continue
            if k in vouched:
                return k
            if k + self.confirm_steps - 1 > last:
                continue
            if not any(s in self.timeline.troubled for s in range(max(0, k - 1), k + self.confirm_steps)):
                return k
        return None

    def vouched(self) -> set[int]:
        """The evaluated versions that scored above every evaluation before them.

        Only a new best counts. A version within --health-eval-drop of the best may already be sliding: an entropy
        collapse scored just below the best at the step it began. A tie adds no evidence over the version it ties."""
        out, best = set(), float("-inf")
        for version, value in sorted(self.timeline.evals):
            if value > best:
                out.add(version)
            best = max(best, value)
        return out

    def stop_target(self, checkpoints: list[int], before: int) -> int | None:
        """The checkpoint a stopped run ends on: of those at or before `before`, the best evaluated one when its
        held-out metric beats that of `target`'s, else `target`. Nothing trains on from a stopped run, so what counts
        is what its weights score, not whether the steps after them were clean; a tie goes to the healthy one."""
        healthy = self.target(checkpoints, before)
        scores = dict(self.timeline.evals)
        candidates = [k for k in checkpoints if k <= before and k in scores]
        if not candidates:
            return healthy
        best = max(candidates, key=lambda k: (scores[k], k))
        if healthy is None or scores[best] > scores.get(healthy, float("-inf")):
            return best
        return healthy

    def best_evaluated(self, checkpoints: list[int]) -> tuple[int, float] | None:
        """(version, metric) of the best held-out evaluation of a version that has a checkpoint (the newest of
        equals); None without one."""
        kept = set(checkpoints)
        scored = [(value, version) for version, value in self.timeline.evals if version in kept]
        if not scored:
            return None
        value, version = max(scored)
        return version, value

    def needed(self, checkpoints: list[int], anchors: list[int]) -> set[int]:
        """The checkpoints a rule could still send the run to.

        An anchor is a point a future rollback could go back to before; each has a target and a stop target. The best
        evaluated checkpoint is needed too, since the end of the run may choose it."""
        needed = {self.target(checkpoints, before) for before in anchors}
        needed |= {self.stop_target(checkpoints, before) for before in anchors}
        best = self.best_evaluated(checkpoints)
        if best is not None:
            needed.add(best[0])
        return {k for k in needed if k is not None}
