"""Warnings that hold: what a lasting warning calls for.

    repush    a trainer-engine mismatch (the log-prob gap, or importance weights beyond the cap, of the tokens sampled
              by the weights the trainer holds) held --health-patience steps: the weights are pushed to the engines
              again and the engines are probed against the trainer (run.engine_check): an engine that disagrees
              is restarted, and stops the run if it still does; when every engine agrees the gap is the policy's
              (or the re-push cured it). Either way no rollback: a gap that survives a verified push is the engine's,
              which rolling the policy back cannot fix. A mismatch that holds on is pushed again (and probed) every
              --health-patience steps.
    rollback  any other warning held --health-patience steps in a row: back to before the streak's first step

Only warnings that changed the run escalate. Standing conditions do not: held since the run's first step, they leave
no healthier state to go back to. The entropy's fall and the length rules escalate only while the training reward
is down too. A mismatch held since the first step is re-pushed all the same: an engine wrong from the start is what
the probe is for. Only warnings
that changed the run keep a checkpoint from being confirmed as a rollback target (health.policy). Else a run that
truncates from the start, or learns to search more, could never roll back to anything recent.
"""

from __future__ import annotations

from slime_search.health.config import HealthConfig
from slime_search.health.events import BEFORE, Event
from slime_search.health.rules.bounds import ENGINE_RULES, REWARD_GATED_RULES


class Escalation:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.streaks: dict[str, int] = {}  # warning rule -> consecutive steps it held, up to the last step reviewed
        self.repushed: dict[str, int] = {}  # mismatch rule -> its streak when the weights were last pushed again

    def lasting(self, step: int, streaks: dict[str, int], first_step: int, reward_down: bool) -> list[str]:
        """The warned rules (with their streaks at `step`) that changed the run."""
        return [
            rule
            for rule, n in streaks.items()
            if step - n + 1 > first_step and (rule not in REWARD_GATED_RULES or reward_down)
        ]

    def streaks_with(self, warned: set[str]) -> dict[str, int]:
        """The streaks once the step's warnings `warned` join them (a rule not warned now ends its streak)."""
        return {rule: self.streaks.get(rule, 0) + 1 for rule in warned}

    def escalate(self, step: int, warned: set[str], first_step: int, reward_down: bool) -> list[Event]:
        """A warning that has held --health-patience steps: a rollback to before the streak's first step (the longest
        streak due speaks; the checkpoint's weights are pushed with it), else, for a trainer-engine mismatch, a
        re-push of the weights and the probe of the engines."""
        streaks = self.streaks_with(warned)
        held = {rule: n - self.repushed.get(rule, 0) for rule, n in streaks.items()}  # since the last re-push
        changed = set(self.lasting(step, streaks, first_step, reward_down)) | (set(streaks) & set(ENGINE_RULES))
        order = {rule: i for i, rule in enumerate(ENGINE_RULES)}  # ties: the gap before the weights' tail, then by name
        due = [rule for rule in changed if held[rule] >= self.config.patience]
        due.sort(key=lambda r: (-streaks[r], order.get(r, len(order)), r))
        policy = [rule for rule in due if rule not in ENGINE_RULES]
        if policy:
            rule = policy[0]
            message = f"step {step}: {', '.join(policy)} held {streaks[rule]} steps in a row"
            return [Event(step, "rollback", rule, message, {BEFORE: float(step - streaks[rule] + 1)})]
        if not due:
            return []
        message = (
            f"step {step}: {', '.join(due)} held {held[due[0]]} steps in a row; the weights are pushed to the engines "
            "again and the engines probed against the trainer"
        )
        return [Event(step, "repush", due[0], message, {"held": float(held[due[0]])})]

    def observe(self, events: list[Event]) -> None:
        """The step's events: its warnings extend their streaks, the others end; a re-push (and the probe that
        follows it) begins the mismatch's count afresh: another --health-patience steps before the next."""
        self.streaks = self.streaks_with({e.rule for e in events if e.action == "warn"})
        self.repushed = {rule: n for rule, n in self.repushed.items() if rule in self.streaks}
        if any(e.action == "repush" for e in events):
            self.repushed.update({rule: n for rule, n in self.streaks.items() if rule in ENGINE_RULES})

    def anchors(self, last_step: int) -> list[int]:
        """The first step of each open streak that could roll back: what a rollback for it would go back to before
        (a mismatch never rolls back)."""
        return [last_step - n + 1 for rule, n in self.streaks.items() if rule not in ENGINE_RULES]

    def reset(self) -> None:
        self.streaks, self.repushed = {}, {}
