"""What the health guard decides: one Event per decision, a line of RUN/health.jsonl and of the report, by severity
(ACTIONS, mildest first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# "watch" is the guard's notice, not a warning: a first held-out fall, whose checkpoint it keeps while it waits for the
# next evaluations (most falls recover by themselves); the user has nothing to do unless it acts
ACTIONS = ("watch", "warn", "refuse", "skip", "repush", "rollback", "stop", "end_on_best")
# a rollback event's value: the trouble began after this step; the target is at or before it
BEFORE = "roll_back_before"


@dataclass(frozen=True)
class Event:
    """One decision of the guard: a line of RUN/health.jsonl and of the report."""

    step: int
    action: str  # one of ACTIONS
    rule: str
    message: str
    values: dict[str, float] = field(default_factory=dict)

    def record(self, attempt: int) -> dict[str, Any]:
        return {
            "step": self.step,
            "action": self.action,
            "rule": self.rule,
            "message": self.message,
            "values": self.values,
            "attempt": attempt,
        }


class RunStopped(RuntimeError):
    """The guard stopped the run; the message names the rule, the step and the values."""
