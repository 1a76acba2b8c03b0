"""One seed's week: the run's parts over the world, started as train.py starts them, and the operator around it.

The operator does what a scheduler and a person do. A driver that was killed is started again with the same command. So
is one that ended with an error naming a fault it cannot wait out (an evaluation inside the step past --eval-timeout).
RunFolder and Recovery are made anew over the same run folder, and `Recovery.resume` continues from its last checkpoint;
a run the guard stopped is started again only once the stop's cause is fixed (an engine that disagrees is swapped; the
stop's refusal of the same command is then lifted by removing RUN/stopped.json, as the refusal says), or at once after a
stop of a fault that passes (the product resumes those itself); any other stop ends the week there.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

from benchmarks.studies.guard_week.beside import SimEvalBeside
from benchmarks.studies.guard_week.parts import LocalActor, SimGroup, SimManager, SimPush
from benchmarks.studies.guard_week.world import DriverKilled, World

logger = logging.getLogger(__name__)
MAX_STARTS = 12  # a week that needs more starts than this has gone wrong: it ends there


def open_parts(world: World, argv: list[str]):
    """RunParts and Recovery as train.main builds them (run.parts.open_parts), with the world's parts and clock."""
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.rollout.schedule import create_schedule
    from slime_search.run.evaluators import BesideEval, InStepEval, eval_deadline
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery

    config = world.config
    run = counted_run_folder(world, config.run_dir)
    run.record_health_config(config.health)
    manager = SimManager(world)
    group = SimGroup(world, manager)
    manager.group = group
    world.manager = manager  # the step the run is at, for what the operator records
    remote = LocalActor(manager)
    push = SimPush(world, manager, group)
    push.connect()
    guard = HealthGuard(config.health, config.rollout.rollout.reward_key)
    colocation = Colocation(config.colocate, group, remote)
    if config.eval_engine is not None:
        evaluator = BesideEval(config, colocation, SimEvalBeside(world, manager, group, eval_deadline(config)[0]))
    else:
        evaluator = InStepEval(config, remote)
    parts = RunParts(
        config, run, MetricsSink(run.path), group, guard, remote, push, colocation, evaluator,
        create_schedule(config.schedule, remote), clock=world.clock,
    )  # fmt: skip
    return parts, Recovery(parts, argv)


def counted_run_folder(world: World, path: str):
    """The run folder, its pruning counted (what --keep-checkpoints removed is not lost) and its events kept as they are
    recorded (a resume drops the warnings, re-pushes and probes of the steps it redoes from RUN/health.jsonl)."""
    from slime_search.run.folder import RunFolder

    run = RunFolder(path)
    prune, prune_undone = run.prune_checkpoints, run._prune_undone

    def counted_prune(keep, protect=()):
        removed = prune(keep, protect)
        world.facts.pruned += len(removed)
        return removed

    def counted_undone(keep):
        removed = prune_undone(keep)
        world.facts.pruned += removed
        return removed

    record_events = run.record_events

    def kept_events(events):  # every decision as the guard records it (a resume drops the redone steps' ones)
        record_events(events)
        world.facts.events.extend(events)

    run.prune_checkpoints, run._prune_undone, run.record_events = counted_prune, counted_undone, kept_events
    return run


def disk_budget(world: World):
    """The budget the run prints when its actor is built (disk_budget.check_disk_budget), with the world's --save disk
    (its size, less the checkpoints already there) in place of this machine's."""
    from dataclasses import replace

    from slime_search.disk_budget import disk_budget as product_budget
    from slime_search.run.folder import RunFolder

    budget = product_budget(world.config, world.week.layout, RunFolder(world.config.run_dir))
    budget = replace(budget, free=world.shape.disk_bytes - budget.on_disk * budget.per_checkpoint)
    logger.info("checkpoints: %.1f GB each, up to %d on disk at once, %.1f GB in all; free %.1f GB", budget.per_checkpoint
                / 1e9, budget.count, budget.total / 1e9, budget.free / 1e9)  # fmt: skip
    if not budget.fits:
        raise RuntimeError(f"the simulated --save disk cannot hold the run's checkpoints: {budget}")
    return budget


def run_week(world: World, argv: list[str]) -> dict:
    """The run, started and restarted by the operator until it ends or a stop the operator cannot fix; returns how it
    ended and the budget printed at its first start."""
    from slime_search.health.guard import RunStopped
    from slime_search.run.loop import run_steps
    from slime_search.run.recovery import repeated_stop

    budget, ended, starts = None, "done", 0
    while True:
        starts += 1
        parts, recovery = open_parts(world, argv)
        refusal = repeated_stop(world.config.run_dir, argv)
        if refusal is not None:  # train.main refuses here; the operator lifts it only after fixing the cause
            ended = f"refused: {refusal}"
            break
        budget = budget or disk_budget(world)
        try:
            start = recovery.resume()
            if starts > 1:
                world.facts.resumed[-1]["from"] = start
            run_steps(parts, recovery, start)
            break
        except RunStopped:
            stop = next(e for e in reversed(world.facts.events) if e["action"] == "stop")
            final = json.loads((parts.folder.path / "final.json").read_text())
            served = "ended_on" in stop["values"] and stop["rule"] != "disk_full"  # the stop loaded its checkpoint last
            newest = world.facts.newest_before_load if served else world.facts.newest
            world.facts.stops.append({"event": stop, "final": final, "newest": newest})
            if not operator_fixes(world, parts, stop, argv):
                ended = f"stopped at step {stop['step']} ({stop['rule']})"
                break
        except DriverKilled:
            restart(world, "driver_killed", world.shape.timing.driver_restart_s, parts)
        except TimeoutError as err:  # an evaluation inside the step past its deadline: run again, it resumes
            if "--eval-timeout" not in str(err):
                raise
            world.note(world.manager.step, "error", "eval_timeout")
            restart(world, "eval_timeout", world.shape.timing.driver_restart_s, parts)
        except OSError as err:  # a save that found the disk full, where the run does not wait it out
            if err.errno != errno.ENOSPC:
                raise
            world.note(world.manager.step, "crash", "disk_full")
            restart(world, "disk_full", world.shape.timing.driver_restart_s, parts)
        finally:
            parts.sink.close()
        if starts >= MAX_STARTS:
            ended = f"ended after {starts} starts"
            break
    return {"ended": ended, "starts": starts, "budget": budget}


def restart(world: World, why: str, after_s: float, parts, step: int | None = None) -> None:
    """The same command again, `after_s` later; the judge sees it as the run's `resume` for `why` at `step` (by
    default the step the run was at)."""
    step = world.manager.step if step is None else step
    world.facts.resumed.append({"why": why, "at_step": step, "newest": parts.folder.latest_checkpoint()})
    world.note(step, "resume", why)
    world.clock.sleep(after_s)


def operator_fixes(world: World, parts, stop: dict, argv: list[str]) -> bool:
    """After a stop: fix what it names, if the world can, and start the run again; False when nothing is to be done."""
    stopped = Path(world.config.run_dir) / "stopped.json"
    transient = stopped.is_file() and json.loads(stopped.read_text()).get("transient", False)
    named = [url for url in world.bad_hardware if url in stop["message"]]
    if stop["rule"] == "engine_mismatch" and named:
        from slime_search.run.recovery import repeated_stop

        world.facts.stops[-1]["refused"] = repeated_stop(world.config.run_dir, argv) is not None  # the same command
        world.bad_hardware -= set(named)  # the engine's GPU swapped
        stopped.unlink(missing_ok=True)  # what the refusal of the same command says to do, once the cause is fixed
        restart(world, "engine_swapped", world.shape.timing.operator_s, parts, stop["step"])
        return True
    if transient:
        restart(world, "passing_fault_stop", world.shape.timing.operator_s, parts, stop["step"])
        return True
    return False
