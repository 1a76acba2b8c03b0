"""The run's health in words, from the guard's events (RUN/health.jsonl): one verdict line, and the events a reader
should see when there are too many to list.

    healthy                                        no event
    healthy; watched N held-out falls, first: MESSAGE   falls the guard waited on without acting
    warned at step k: RULE (M warnings, R refused updates, S skipped steps[; paused P times for faults that passed]);
        first: MESSAGE
    rolled back N times; last at step k: RULE: MESSAGE
    stopped at step k: MESSAGE

The most severe situation wins: a stop over rollbacks, rollbacks over warnings, warnings over watches (a watch is the
guard waiting on a held-out fall with the checkpoint before it kept; it asks nothing of the user). A stop the run was
resumed after (a "resume" event follows it) no longer ends it. A run that ended on its best evaluated checkpoint says so after its
situation: "...; ended on its best checkpoint: MESSAGE" (the message names the step).
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE = 300  # characters of one event's message in the verdict: the line stays one line on a terminal
LASTING = ("rollback", "stop", "resume", "end_on_best")  # events that changed the run's course: always listed


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


def final_stop(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stop that ended the run, unless the run was resumed after it (a "resume" event follows it)."""
    for event in reversed(events):
        if event.get("action") == "resume":
            return None
        if event.get("action") == "stop":
            return event
    return None


def level(events: list[dict[str, Any]]) -> str:
    """healthy | warned | rolled_back | stopped: the most severe situation of the run."""
    events = [e for e in events if e.get("action") not in ("end_on_best", "watch")]
    actions = {e.get("action") for e in events if e.get("action") not in ("stop", "resume")}
    if final_stop(events) is not None:
        return "stopped"
    if "rollback" in actions:
        return "rolled_back"
    return "warned" if events else "healthy"


def verdict(events: list[dict[str, Any]]) -> str:
    """One line that says how the run went (see the module's docstring)."""
    ended = [e for e in events if e.get("action") == "end_on_best"]
    line = situation_line([e for e in events if e.get("action") != "end_on_best"])
    if not ended:
        return line
    last = ended[-1]
    return f"{line}; ended on its best checkpoint: {shorten(last['message'])}"


def situation_line(events: list[dict[str, Any]]) -> str:
    """The verdict's first part: healthy, warned, rolled back or stopped."""
    situation = level(events)
    watched = [e for e in events if e.get("action") == "watch"]
    if situation == "healthy":
        if not watched:
            return "healthy"
        falls = "1 held-out fall" if len(watched) == 1 else f"{len(watched)} held-out falls"
        return f"healthy; watched {falls}, first: {shorten(watched[0]['message'])}"
    if situation == "stopped":
        stop = final_stop(events)
        return f"stopped at step {stop['step']}: {shorten(stop['message'])}"
    if situation == "rolled_back":
        rollbacks = completed_rollbacks(events)
        last = rollbacks[-1]
        times = "1 time" if len(rollbacks) == 1 else f"{len(rollbacks)} times"
        return f"rolled back {times}; last at step {last['step']}: {last['rule']}: {shorten(last['message'])}"
    # a stop the run was resumed after; the watches of a run that warned are in its report, not in its one line
    events = [e for e in events if e.get("action") not in ("stop", "resume", "watch")]
    if not events:
        return "healthy"
    first = events[0]
    counts = {action: sum(e.get("action") == action for e in events) for action in ("warn", "refuse", "skip", "pause")}
    paused = f"; paused {counts['pause']} times for faults that passed" if counts["pause"] else ""
    return (
        f"warned at step {first['step']}: {first['rule']} ({counts['warn']} warnings, {counts['refuse']} refused "
        f"updates, {counts['skip']} skipped steps{paused}); first: {shorten(first['message'])}"
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
