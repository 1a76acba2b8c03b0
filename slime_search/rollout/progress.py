"""Waiting on a RolloutManager call with its progress in sight: a bar on a terminal, a plain line every so often in a
log that is not one."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)
PROGRESS_LINE_EVERY_S = 30.0  # how often a rollout's progress is logged when stderr is not a terminal


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


def wait_with_progress(manager, ref, desc: str, deadline_s: float | None = None):
    """Wait for a RolloutManager call, drawing a progress bar over its samples on a terminal, else logging a progress
    line every PROGRESS_LINE_EVERY_S seconds; TimeoutError when it has no result within `deadline_s` (None: no
    deadline)."""
    import ray
    from tqdm import tqdm

    with tqdm(desc=desc, unit="sample", disable=None, leave=False) as bar:
        lines = ProgressLines(desc, time.monotonic())
        while True:
            if deadline_s is not None and time.monotonic() - lines.start > deadline_s:
                raise TimeoutError(f"{desc}: no result within {deadline_s:g} s")
            ready, _ = ray.wait([ref], timeout=0.5)
            done, total = ray.get(manager.progress.remote())
            bar.n, bar.total = done, total
            bar.refresh()
            line = lines.line(done, total, time.monotonic()) if bar.disable else None  # disabled: not a terminal
            if line is not None:
                logger.info(line)
            if ready:
                return ray.get(ref)
