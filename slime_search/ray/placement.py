"""The RolloutManager actor from the driver's side: where it runs, and so where its engines run (on GPUs of their own,
which Ray gives to the manager and keeps apart from the actor's; on the actor's GPUs with --colocate; or the CPU
engine on a CPU machine), waiting on its calls with a progress bar, and stopping it."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)
PROGRESS_LINE_EVERY_S = 30.0  # how often a rollout's progress is logged when stderr is not a terminal


def create_rollout_manager(config, plugin_args, group, colocate: bool):
    """The RolloutManager actor (`config`: a RolloutManagerConfig), which starts the engines. Colocated engines take
    the actor's GPUs in rank order, so engine e's TP rank i sits on trainer rank e*k+i's device."""
    import ray

    from slime_search.rollout.manager import RolloutManager

    on_gpu = group.config.use_gpu
    rollout_gpus = config.engines.num_gpus if on_gpu and not colocate else 0
    gpu_ids = group.gpu_ids() if on_gpu and colocate else None
    options = {"num_cpus": 0, "num_gpus": rollout_gpus, "max_concurrency": 4}
    return ray.remote(RolloutManager).options(**options).remote(config, plugin_args, gpu_ids)


def stop_rollout_manager(manager) -> None:
    """Stop the engines the manager started, then the actor itself (also when its start-up failed)."""
    import ray

    try:
        ray.get(manager.shutdown.remote(), timeout=60)
    except Exception as err:  # noqa: BLE001 - a manager that failed to start has nothing to stop
        logger.warning("rollout manager shutdown: %s", err)
    ray.kill(manager)


class ProgressLines:
    """Plain progress lines for a log that is not a terminal (where a progress bar shows nothing): at most one every
    `every_s` seconds."""

    def __init__(self, desc: str, start: float, every_s: float = PROGRESS_LINE_EVERY_S):
        self.desc, self.start, self.every_s = desc, start, every_s
        self.last = start

    def line(self, done: int, total: int, now: float) -> str | None:
        """The line to print at `now` (seconds on the clock `start` was read from), or None when it is not yet due."""
        if now - self.last < self.every_s:
            return None
        self.last = now
        return f"{self.desc}: {done}/{total} samples, {now - self.start:.0f} s"


def wait_with_progress(manager, ref, desc: str):
    """Wait for a RolloutManager call, drawing a progress bar over its samples on a terminal, else logging a progress
    line every PROGRESS_LINE_EVERY_S seconds."""
    import ray
    from tqdm import tqdm

    with tqdm(desc=desc, unit="sample", disable=None, leave=False) as bar:
        lines = ProgressLines(desc, time.monotonic())
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            done, total = ray.get(manager.progress.remote())
            bar.n, bar.total = done, total
            bar.refresh()
            line = lines.line(done, total, time.monotonic()) if bar.disable else None  # disabled: not a terminal
            if line is not None:
                logger.info(line)
            if ready:
                return ray.get(ref)
