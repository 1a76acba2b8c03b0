"""The health guard replayed over a run's recorded metrics, as it would have acted on them."""

from __future__ import annotations

from slime_search.health.config import HealthConfig
from slime_search.health.guard import Event, HealthGuard


def replay(records: list[dict], config: HealthConfig, grades: dict[int, list[float]] | None = None) -> list[Event]:
    """Every event the guard would have raised over these records, in order (rollbacks are decided, not done), and
    its decision at the end of the run, taking every evaluated version as checkpointed (with the guard on, every
    evaluated version is). `grades`: the evaluations' per-question grades by version (RUN/eval_grades.jsonl), for the
    paired held-out tests; without them the held-out rules judge the point estimates."""
    guard = HealthGuard(config)
    events: list[Event] = []
    evaluated = []
    for record in records:
        if "time/step_s" in record:
            events += guard.check_rollout(record["step"], record, {}) + guard.review(record["step"], record)
        elif "eval/score" in record:
            events += guard.review_eval(record["step"], record, (grades or {}).get(record["step"]))
            evaluated.append(record["step"])
    end = guard.end_on_best(evaluated)
    return events if end is None else [*events, end]
