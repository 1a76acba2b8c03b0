"""The health guard: the run's own numbers, checked after every rollout, every batch and every step.

What they say is acted on, by severity: stop, skip a step, wait out a fault that passes (pause), refuse an update,
warn, push the weights again, or roll back to a kept checkpoint (health.policy). At the end of the run it may end on
the best evaluated checkpoint. Each rule family is a module of health.rules, which says what it decides and why. The
rollbacks done and their budget are health.ledger's.

Its state is a function of the run's records (metrics.jsonl) and rollbacks: a resumed run replays them (`replay`).
Without --health-guard only the checks of what a step is given (health.rules.inputs) and non-finite updates remain.
"""

from __future__ import annotations

from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import ACTIONS, BEFORE, Event, RunStopped
from slime_search.health.ledger import RollbackLedger
from slime_search.health.policy import RollbackPolicy, Timeline
from slime_search.health.records import num
from slime_search.health.rules.bounds import policy_jump, signal_warnings
from slime_search.health.rules.end import EndRule
from slime_search.health.rules.escalation import Escalation
from slime_search.health.rules.held_out import HeldOutRule
from slime_search.health.rules.inputs import StepInputs, no_sample_cause
from slime_search.health.rules.reward import RewardRule
from slime_search.health.rules.updates import UpdateRefusals, refused_whole_step

__all__ = ["ACTIONS", "BEFORE", "Event", "HealthGuard", "RunStopped", "no_sample_cause"]


class HealthGuard:
    def __init__(self, config: HealthConfig, reward_key: str = "score"):
        self.config, self.eval_key = config, f"eval/{reward_key}"
        self.timeline = Timeline()
        self.policy = RollbackPolicy(config.confirm_steps, self.timeline)
        self.ledger = RollbackLedger(config.max_rollbacks, config.rollback_window)
        self.inputs, self.updates = StepInputs(config), UpdateRefusals(config)
        self.escalation, self.reward = Escalation(config), RewardRule(config)
        self.held_out = HeldOutRule(config, self.timeline, self.eval_key)
        self.end = EndRule(config, self.timeline, self.policy, self.eval_key)
        # what a step is given (health.rules.inputs), and the rollbacks' budget (health.ledger), as they answer it
        self.check_rollout, self.check_batch = self.inputs.check_rollout, self.inputs.check_batch
        self.check_save = self.inputs.check_save  # a --save disk too full for a checkpoint: waited out
        self.recent_rollbacks, self.rollback_left = self.ledger.recent, self.ledger.left
        # the end of the run, judged on the final version's own evaluation (health.rules.end)
        self.final_version, self.end_candidate = self.end.final_version, self.end.candidate
        self.end_on_best, self.end_on_confirmed = self.end.on_best, self.end.on_confirmed

    # ---- the rollbacks done (health.ledger); a resumed run sets them from its run folder ----------------------------
    rollback_steps = property(lambda g: g.ledger.steps, lambda g, steps: setattr(g.ledger, "steps", steps))
    rollback_targets = property(lambda g: g.ledger.targets, lambda g, targets: setattr(g.ledger, "targets", targets))

    @property
    def rollbacks(self) -> int:
        return len(self.ledger)

    def rollback_target(self, checkpoints: list[int], before: int) -> int | None:
        """Where a rollback for trouble that began after `before` goes, passing over recent rollbacks' targets; while
        a held-out fall is watched, no later than its last version within the margin (whatever rule rolls back)."""
        if self.held_out.falls:
            before = min(before, self.held_out.last_good())
        return self.policy.target(checkpoints, before, self.ledger.recent_targets(self.timeline.last_step()))

    def skip_above(self) -> float | None:
        """The gradient norm above which the optimizer refuses an update (None with the guard off)."""
        return self.updates.skip_above(self.timeline.history) if self.config.enabled else None

    # ---- after the step, and after an evaluation ------------------------------------------------------------------
    def review(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """The step's events (refused updates, warnings, a re-push or a rollback when one is due), then the step
        joins the history. `metrics` is the step's whole record, health/step_skipped included."""
        events = self.updates.refusals(step, metrics, self.inputs.skip)
        reward_down = self.reward.down(step, metrics)
        first = self.timeline.first_step(step)
        if self.config.enabled and not metrics.get("health/step_skipped"):
            warnings = signal_warnings(step, metrics, self.timeline.history, self.config, reward_down)
            events += warnings
            events += self.escalation.escalate(step, {e.rule for e in warnings}, first, reward_down)
            events += policy_jump(step, metrics, self.config) + self.reward.drop(step, metrics)
        self.escalation.observe(events)
        self.updates.observe(step, metrics)
        skipped = bool(metrics.get("health/step_skipped")) or refused_whole_step(metrics)
        self.inputs.observe(skipped)
        # only warnings that changed the run veto a checkpoint's confirmation (health.rules.escalation)
        changed = self.escalation.lasting(step, self.escalation.streaks, first, reward_down)
        if skipped or changed or any(e.action in ("refuse", "skip") for e in events):
            self.timeline.troubled.add(step)
        self.timeline.history.append({**metrics, "step": step})
        self.reward.observe(step, metrics)
        return events

    def review_eval(self, version: int, metrics: dict[str, Any], grades: list[float] | None = None) -> list[Event]:
        """A held-out evaluation of `version` (`grades`: its per-question grades of the reward key, in the eval set's
        order), reviewed by health.rules.held_out: a fall is first watched, a lasting one rolled back."""
        value = num(metrics, self.eval_key)
        if value is None:
            return []
        events = self.held_out.review(version, value, grades) if self.config.enabled else []
        self.timeline.record_eval(version, value, grades, num(metrics, f"{self.eval_key}_high"))
        return events

    # ---- what pruning keeps, rollbacks, resume -----------------------------------------------------------------------
    def rollback_anchors(self) -> list[int]:
        """Every point a rule could still roll back to before, from the next step on.

        They are the next step itself (a policy jump, a new warning streak) and the first step of each open streak.
        They are also the reward's anchor, the last held-out version within the margin, and the checkpoint before
        each recent rollback's target. Later anchors only move forward. So the checkpoints these name are all a
        rollback can ask for (RollbackPolicy.needed)."""
        if not self.config.enabled:
            return []
        last = self.timeline.last_step()
        anchors = [last + 1, *self.escalation.anchors(last)]
        if (reward := self.reward.anchor()) is not None:
            anchors.append(reward)
        if self.timeline.evals:
            anchors.append(self.held_out.last_good())
        return anchors + self.ledger.anchors(last)

    def checkpoints_needed(self, checkpoints: list[int]) -> set[int]:
        """What --keep-checkpoints must not remove: every checkpoint a rule could still send the run to."""
        return self.policy.needed(checkpoints, self.rollback_anchors()) if self.config.enabled else set()

    def rolled_back(self, to_step: int, at_step: int) -> None:
        """The run continues from `to_step` (steps done at the checkpoint), after a rollback decided at `at_step`:
        later history is forgotten."""
        self.ledger.record(to_step, at_step)
        self._restart(to_step)

    def _restart(self, step: int) -> None:
        """Go on from `step`: what followed it forgotten, the streaks and the runs in a row begun afresh."""
        self.escalation.reset()
        self.inputs.skipped_in_a_row, self.held_out.falls = 0, []
        for part in (self.timeline, self.updates, self.reward):
            part.forget_from(step)

    def replay(self, records: list[dict[str, Any]], rollback_steps: list[int],
               grades: dict[int, list[float]] | None = None, rollback_targets: list[int] | None = None) -> None:  # fmt: skip
        """Rebuild the state of a resumed run from the records it kept (in file order), its rollbacks and its
        evaluations' grades.

        The rollbacks come as their steps and targets. Where the records went on after one, the streaks began afresh."""
        self.rollback_steps, self.rollback_targets = list(rollback_steps), list(rollback_targets or [])
        restarts = self.ledger.restarts()
        for record in records:
            while restarts and record["step"] >= restarts[0]:
                self._restart(restarts.pop(0))
            if "time/step_s" in record:
                self.review(record["step"], record)
            elif self.eval_key in record:
                self.review_eval(record["step"], record, (grades or {}).get(record["step"]))
        for step in restarts:  # rolled back to after every record kept
            self._restart(step)
