"""The run's health in words, from the guard's events (RUN/health.jsonl): one verdict line, and the events a reader
should see when there are too many to list.

    healthy                                        no event
    warned at step k: RULE (M warnings, R refused updates, S skipped steps); first: MESSAGE
    rolled back N times; last at step k: RULE: MESSAGE
    stopped at step k: MESSAGE

The most severe situation wins: a stop over rollbacks, rollbacks over warnings.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE = 300  # characters of one event's message in the verdict: the line stays one line on a terminal
LASTING = ("rollback", "stop")  # events that changed the run's course: always listed


def shorten(message: str, limit: int = MAX_MESSAGE) -> str:
    """The message on one line (newlines and runs of spaces collapsed), cut at `limit` characters with an ellipsis."""
    flat = " ".join(str(message).split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def completed_rollbacks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rollbacks that happened: the event naming the checkpoint gone back to. A run cut short between a rollback's
    decision and its completion still rolled back, so then the decisions count."""
    rollbacks = [e for e in events if e.get("action") == "rollback"]
    done = [e for e in rollbacks if "to_step" in (e.get("values") or {})]
    return done or rollbacks


def level(events: list[dict[str, Any]]) -> str:
    """healthy | warned | rolled_back | stopped: the most severe situation of the run."""
    actions = {e.get("action") for e in events}
    if "stop" in actions:
        return "stopped"
    if "rollback" in actions:
        return "rolled_back"
    return "warned" if events else "healthy"


def verdict(events: list[dict[str, Any]]) -> str:
    """One line that says how the run went (see the module's docstring)."""
    situation = level(events)
    if situation == "healthy":
        return "healthy"
    if situation == "stopped":
        stop = next(e for e in events if e.get("action") == "stop")
        return f"stopped at step {stop['step']}: {shorten(stop['message'])}"
    if situation == "rolled_back":
        rollbacks = completed_rollbacks(events)
        last = rollbacks[-1]
        times = "1 time" if len(rollbacks) == 1 else f"{len(rollbacks)} times"
        return f"rolled back {times}; last at step {last['step']}: {last['rule']}: {shorten(last['message'])}"
    first = events[0]
    counts = {action: sum(e.get("action") == action for e in events) for action in ("warn", "refuse", "skip")}
    return (
        f"warned at step {first['step']}: {first['rule']} ({counts['warn']} warnings, {counts['refuse']} refused "
        f"updates, {counts['skip']} skipped steps); first: {shorten(first['message'])}"
    )


def events_shown(events: list[dict[str, Any]], head: int = 50, tail: int = 50) -> list[dict[str, Any] | int]:
    """The events to list: the first `head`, the last `tail` and every rollback and stop, in order; an int in the list
    stands for that many events left out at that place."""
    rows: list[dict[str, Any] | int] = []
    omitted = 0
    for index, event in enumerate(events):
        if index < head or index >= len(events) - tail or event.get("action") in LASTING:
            if omitted:
                rows.append(omitted)
                omitted = 0
            rows.append(event)
        else:
            omitted += 1
    return [*rows, omitted] if omitted else rows
