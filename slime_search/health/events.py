"""What the health guard decides: one Event per decision, a line of RUN/health.jsonl and of the report, by severity
(ACTIONS, mildest first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# "watch" is the guard's notice, not a warning: a first held-out fall, whose checkpoint it keeps while it waits for the
# next evaluations (most falls recover by themselves); the user has nothing to do unless it acts
# "pause": a fault that passes (the retriever down, a reward service timing out, a full disk) is waited out and the
# step's rollout (or the save) done again; nothing is trained on what it broke (health.rules.inputs)
# "probe": the engines' log-probs of the same tokens against the trainer's, right after a push (run.engine_check),
# its values each engine's mean gap by address; "restart_engine": an engine that disagreed is started again and pushed
# the current weights, then probed again (still disagreeing, it stops the run)
ACTIONS = (
    "watch", "warn", "probe", "pause", "refuse", "skip", "repush", "restart_engine", "rollback", "stop", "end_on_best",
)  # fmt: skip
# a rollback event's value: the trouble began after this step; the target is at or before it
BEFORE = "roll_back_before"
# a pause's or stop's value: how long the fault has lasted (seconds on the run's clock); a stop that holds it stopped
# a fault that passes at --health-max-outage-hours, and the same command may run again once it has passed
OUTAGE = "outage_s"


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


class Decision(Exception):  # noqa: N818 - a decision, not an error: the loop carries it out (run.loop)
    """A rollback or a stop the guard decided, on its way to the training loop.

    The loop carries both out the same way (Recovery.carry_out). A rollback returns the step to go on from. A stop
    ends the run with RunStopped."""

    def __init__(self, event: Event):
        super().__init__(event.message)
        self.event = event
