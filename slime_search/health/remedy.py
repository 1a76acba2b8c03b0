"""What a rollback changes for the rest of the run: the learning rate, and how stale asynchronous batches may be.

After the n-th rollback the learning rate is the schedule's times lr_factor^n; in --async-mode fully the staleness bound
is lowered by one per rollback and, once it would fall below 1, the run continues one-step off (every batch one
version behind, none older). Synchronous and one-step runs keep their mode. A pure function of the rollback count, so
a resumed run recovers its remedy from its rollback history.
"""

from __future__ import annotations

from dataclasses import replace

from slime_search.rollout.schedule import ScheduleConfig


def remedied_schedule(schedule: ScheduleConfig, rollbacks: int) -> ScheduleConfig:
    if schedule.mode != "fully" or rollbacks <= 0:
        return schedule
    staleness = schedule.max_staleness - rollbacks
    if staleness >= 1:
        return replace(schedule, max_staleness=staleness)
    return ScheduleConfig("one-step", 1)


def lr_scale(lr_factor: float, rollbacks: int) -> float:
    return lr_factor ** max(0, rollbacks)
