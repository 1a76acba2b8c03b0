"""The judge of a week. Every fault gets its right answer(s), and nothing happens outside the faults. No fault that
passes stops the run, and no checkpoint is lost. The disk stays within the budget the run printed, and the run ends on
the checkpoint it should.

"Should": the last step's, unless a fault that ends the run says otherwise; in these weeks the one such fault is the
engine whose log-probs stay wrong. It ends its run on the newest checkpoint. The week's operator swaps the engine and
runs it on to the end, which must again end on the last step.
"""

from __future__ import annotations

import json

from benchmarks.studies.guard_week.faults import PASSING, Fault, matches


def windows(faults: dict[str, int], catalogue: dict[str, Fault], met: dict[str, list[int]], steps: int) -> dict:
    """Each fault's window of steps: from its step for its span; a passing fault's from the first to the last step
    whose tries met it (one after, for the try that succeeded); an evaluation that hangs, to the end of the run."""
    out = {}
    for kind, at in faults.items():
        if kind in PASSING and met.get(kind):
            out[kind] = (min(met[kind]), max(met[kind]) + 1)
        elif kind == "eval_hang":
            out[kind] = (at, steps)
        else:
            out[kind] = (at, at + catalogue[kind].span)
    return out


def classify(faults: dict[str, int], catalogue: dict[str, Fault], events: list[dict], actions, met, steps: int):
    """The guard's events and the run's own actions by the fault whose window they fall in and whose answers (or what
    it may cause) they are; the others, as (step, action, rule)."""
    spans = windows(faults, catalogue, met, steps)
    acted = {kind: [] for kind in faults}
    outside = []
    found = [(e["step"], e["action"], e["rule"]) for e in events if not completes(e)]
    for step, action, rule in sorted(found + [tuple(a) for a in actions], key=lambda x: x[0]):
        kind = next(
            (
                k
                for k, (a, b) in spans.items()
                if a <= step <= b and matches((action, rule), catalogue[k].answers | catalogue[k].also)
            ),
            None,
        )
        if kind is None:
            outside.append((step, action, rule))
        else:
            acted[kind].append((action, rule))
    return acted, outside


def completes(event: dict) -> bool:
    """A record that repeats a decision already counted: a rollback's completion, a resume after a stop."""
    return event["action"] == "resume" or "to_step" in event.get("values", {})


def answered(faults, catalogue: dict[str, Fault], acted: dict[str, list]) -> dict[str, bool]:
    """Whether every answer each fault calls for was given (anything harsher counts outside)."""
    return {
        kind: all(any(matches(a, {want}) for a in acted[kind]) for want in catalogue[kind].answers) for kind in faults
    }


def checks(faults: dict[str, int], facts) -> dict[str, str]:
    """What an answer must also have done, per fault (an empty string: it did)."""
    problems = {}
    if "wrong_engine" in faults:
        stop = next((s for s in facts.stops if s["event"]["rule"] == "engine_mismatch"), None)
        if stop is None:
            problems["wrong_engine"] = "no stop naming the engine"
        elif facts.bad_engine not in stop["event"]["message"]:
            problems["wrong_engine"] = f"the stop does not name the engine {facts.bad_engine}"
        elif not stop.get("refused"):
            problems["wrong_engine"] = "the same command was not refused after the stop"
        elif stop["final"]["step"] != stop["newest"]:
            problems["wrong_engine"] = (
                f"ended on step {stop['final']['step']}, the newest checkpoint is {stop['newest']}"
            )
    if "driver_kill" in faults:
        resumed = next((r for r in facts.resumed if r["why"] == "driver_killed"), None)
        if resumed is None or resumed.get("from") != resumed["newest"]:
            problems["driver_kill"] = f"resumed {resumed} instead of from the newest checkpoint"
    if "engine_death" in faults and not all(ok for _, ok in facts.served_after_restart):
        problems["engine_death"] = "the restarted engine did not serve the next push"
    return problems


def judge(world, catalogue: dict[str, Fault], run, outcome: dict) -> dict:
    """The week's verdicts, as one JSON-able record."""
    facts, config = world.facts, world.config
    events = facts.events
    acted, outside = classify(world.faults, catalogue, events, facts.actions, facts.met, config.num_rollout)
    right = answered(world.faults, catalogue, acted)
    problems = checks(world.faults, facts)
    problems.update({k: "not reached: the run ended before it" for k in world.faults if k not in world.fired})
    for kind in problems:
        right[kind] = False
    spans = windows(world.faults, catalogue, facts.met, config.num_rollout)
    passing_stops = [
        (e["step"], e["rule"])
        for e in events
        if e["action"] == "stop" and any(k in PASSING and spans[k][0] <= e["step"] <= spans[k][1] for k in spans)
    ]
    present = len(run.checkpoint_steps()) + len(run.undone_checkpoints())
    final_path = run.path / "final.json"
    final = json.loads(final_path.read_text()) if final_path.is_file() else None
    budget = outcome["budget"]
    return {
        "faults": world.faults,
        "right_action": right,
        "problems": problems,
        "acted": {k: sorted(set(map(tuple, v))) for k, v in acted.items()},
        "outside_windows": outside,
        "stops_on_passing_faults": passing_stops,
        "checkpoints_saved": facts.saved,
        "checkpoints_lost": facts.saved - present - facts.pruned,
        "peak_bytes": facts.peak_bytes,
        "peak_checkpoints": facts.peak_folders,
        "budget_bytes": budget.total if budget else None,
        "budget_checkpoints": budget.count if budget else None,
        "final": final,
        "final_expected": config.num_rollout,
        "ended": outcome["ended"],
        "starts": outcome["starts"],
        "rollbacks": sum(1 for e in events if e["action"] == "rollback" and "to_step" in e.get("values", {})),
        "sim_hours": round(world.clock.now() / 3600, 2),
        "eval_blind_hours": round(facts.eval_blind_s / 3600, 2),
    }


def verdict(result: dict) -> bool:
    """Whether the week met every target."""
    final = result["final"] or {}
    return (
        all(result["right_action"].values())
        and not result["outside_windows"]
        and not result["stops_on_passing_faults"]
        and result["checkpoints_lost"] == 0
        and result["budget_bytes"] is not None
        and result["peak_bytes"] <= result["budget_bytes"]
        and final.get("step") == result["final_expected"]
    )
