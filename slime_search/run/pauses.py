"""Faults that pass, waited out by the driver.

A step's rollout whose searches or rewards failed for a passing fault is done again (the retriever down, a reward
service timing out). A checkpoint the --save disk had no room for is saved again. Each waits first for the pause the
guard names (health.rules.inputs), up to --health-max-outage-hours for one fault; then the run stops. Every wait goes
through the run's clock (`RunParts.clock`), so a simulation runs an outage in no time.

Each try draws fresh prompts; those of a failed try's batch are passed over, as a skipped step's are. So a fault that
only some inputs meet (a query that crashes the retriever) is not met again and again. The step count does not move,
so the run still trains --num-rollout steps.

With a stream (--async-mode one-step or fully), the stream is stopped while the run waits. What is in flight is
cancelled, since it would fail too. The prompts it had taken but not handed to the trainer are given back, and the
restarted stream generates them again under the weights the engines serve. A stream left running through the wait
would deadlock: its admission counts batches taken against versions pushed, and no version is pushed while a step is
being redone.
"""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING

from slime_search.health.rules.inputs import RETRY_IN
from slime_search.utils.faults import disk_full_error

if TYPE_CHECKING:
    from slime_search.health.events import Event
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery

logger = logging.getLogger(__name__)


def usable_rollout(parts: RunParts, recovery: Recovery, step: int):
    """The step's batch, the guard's events on it and the seconds spent waiting out passing faults before it came.

    The events are reported, and a stop is raised to the loop. The pauses' events come first in the list."""
    import ray

    pauses, paused_s = [], 0.0
    while True:
        batch = parts.schedule.next_batch(step, parts.config.log_rollout_examples)
        events = recovery.report(parts.guard.check_rollout(step, batch.metrics, batch.errors, parts.clock.now()))
        pause = next((event for event in events if event.action == "pause"), None)
        if pause is None:
            return batch, [*pauses, *events], paused_s
        pauses.append(pause)
        data = ray.get(
            parts.manager.state_dict.remote()
        )  # with a stream: what it took and did not hand over, given back
        parts.schedule.stop()
        ray.get(parts.manager.load_state_dict.remote(data))
        paused_s += wait(parts.clock, pause.values[RETRY_IN])
        parts.schedule.start(step)  # the engines serve the weights of `step` steps


def save_checkpoint(parts: RunParts, recovery: Recovery, steps_done: int) -> None:
    """`parts.save(steps_done)`, saved again while the --save disk has no room for it (ENOSPC, EDQUOT).

    After a full disk the partial folder is removed; the earlier checkpoints and the tracker were never touched. The run
    says how much room one checkpoint needs, and saves again after the guard's pause. It stops once
    --health-max-outage-hours have passed. Any other error of the save propagates."""
    while True:
        try:
            parts.save(steps_done)
        except Exception as err:
            full = disk_full_error(err)
            if full is None:
                raise
            remove_partial(parts.folder.checkpoints, steps_done)
            [event] = parts.guard.check_save(steps_done, disk_full_message(parts, full), parts.clock.now())
            report_on_full_disk(recovery, event)
            wait(parts.clock, event.values[RETRY_IN])
            continue
        parts.guard.check_save(steps_done, None)
        return


def wait(clock, seconds: float) -> float:
    """Sleep `seconds` on `clock`; returns the seconds that passed on it."""
    started = clock.now()
    clock.sleep(seconds)
    return clock.now() - started


def remove_partial(root, steps_done: int) -> None:
    """The folder a failed save left (the actor's ranks remove it too; this covers a rank that could not)."""
    from slime_search.backends.megatron.checkpoint import partial_dir

    shutil.rmtree(partial_dir(root, steps_done), ignore_errors=True)


def free_bytes(path) -> int:
    """Bytes free on the disk of `path` (its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full_message(parts: RunParts, full: OSError) -> str:
    """What the user reads: the --save disk, the error, the room one checkpoint needs and the room there is."""
    needs = parts.checkpoint_bytes
    free = free_bytes(parts.folder.checkpoints)
    room = f"one checkpoint needs {needs / 1e9:.1f} GB, " if needs else ""
    return (
        f"the disk of --save {parts.folder.path} has no room for it ({full.strerror or full}); {room}{free / 1e9:.1f} GB are "
        f"free there: free space on that disk, or keep fewer checkpoints (a lower --keep-checkpoints)"
    )


def report_on_full_disk(recovery: Recovery, event: Event) -> None:
    """The pause (or stop) recorded like every event; on a disk so full that not even the line of RUN/health.jsonl
    fits, a pause is logged only (the wait goes on: the line is not what the run waits for)."""
    try:
        recovery.report([event])
    except OSError as err:
        if event.action == "stop" or disk_full_error(err) is None:
            raise
        logger.warning("health pause (%s): %s (not recorded: %s)", event.rule, event.message, err.strerror)
