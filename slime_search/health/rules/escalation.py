"""Warnings that hold: what a lasting warning calls for.

    repush    a trainer-engine mismatch (the log-prob gap, or importance weights beyond the cap) held --health-patience
              steps: the engines may serve other weights than the trainer's, so the weights are pushed again before
              the policy is blamed; a mismatch that holds half as long again after that rolls back
    rollback  any other warning held --health-patience steps in a row: back to before the streak's first step

Only warnings that changed the run escalate: not standing conditions (held since the run's first step: there is no
healthier state to go back to), and length rules only while the training reward is down too. Only these keep a
checkpoint from being confirmed as a rollback target (health.policy): else a run that truncates from the start, or
learns to search more, could never roll back to anything recent.
"""

from __future__ import annotations

from slime_search.health.config import HealthConfig
from slime_search.health.events import BEFORE, Event
from slime_search.health.rules.bounds import ENGINE_RULES, LENGTH_RULES


class Escalation:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.streaks: dict[str, int] = {}  # warning rule -> consecutive steps it held, up to the last step reviewed
        self.repushed_at: int | None = None  # the engine-mismatch streak's length when the weights were pushed again

    def lasting(self, step: int, streaks: dict[str, int], first_step: int, reward_down: bool) -> list[str]:
        """The warned rules (with their streaks at `step`) that changed the run."""
        return [
            rule
            for rule, n in streaks.items()
            if step - n + 1 > first_step and (rule not in LENGTH_RULES or reward_down)
        ]

    def streaks_with(self, warned: set[str]) -> dict[str, int]:
        """The streaks once the step's warnings `warned` join them (a rule not warned now ends its streak)."""
        return {rule: self.streaks.get(rule, 0) + 1 for rule in warned}

    def escalate(self, step: int, warned: set[str], first_step: int, reward_down: bool) -> list[Event]:
        """A warning that has held long enough: a re-push of the weights for an engine mismatch the first time, else
        a rollback to before the streak's first step (the longest streak due speaks)."""
        streaks = self.streaks_with(warned)
        lasting = sorted(
            (rule for rule in self.lasting(step, streaks, first_step, reward_down) if self._due(rule, streaks[rule])),
            key=lambda r: -streaks[r],
        )
        if not lasting:
            return []
        rule = lasting[0]
        message = f"step {step}: {', '.join(lasting)} held {streaks[rule]} steps in a row"
        if rule in ENGINE_RULES and self.repushed_at is None:
            message += "; the weights are pushed to the engines again before the policy is blamed"
            return [Event(step, "repush", rule, message, {"held": float(streaks[rule])})]
        return [Event(step, "rollback", rule, message, {BEFORE: float(step - streaks[rule] + 1)})]

    def _due(self, rule: str, held: int) -> bool:
        """After --health-patience steps; a mismatch that held on after its re-push after half as many more (the
        engines then hold the trainer's weights: what is left is the policy's)."""
        if rule not in ENGINE_RULES or self.repushed_at is None:
            return held >= self.config.patience
        return held - self.repushed_at >= max(1, self.config.patience // 2)

    def observe(self, events: list[Event]) -> None:
        """The step's events: its warnings extend their streaks, the others end; a re-push notes where it happened."""
        self.streaks = self.streaks_with({e.rule for e in events if e.action == "warn"})
        engine_streaks = [n for rule, n in self.streaks.items() if rule in ENGINE_RULES]
        if not engine_streaks:
            self.repushed_at = None
        if any(e.action == "repush" for e in events):
            self.repushed_at = max(engine_streaks)

    def anchors(self, last_step: int) -> list[int]:
        """The first step of each open streak: what a rollback for it would go back to before."""
        return [last_step - n + 1 for n in self.streaks.values()]

    def reset(self) -> None:
        self.streaks, self.repushed_at = {}, None
