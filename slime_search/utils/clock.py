"""The run's clock, which the waits of a run go through (a passing fault waited out, a save retried). A simulation can
put a clock of its own in its place and run an hour-long outage in no time (`RunParts.clock`)."""

from __future__ import annotations

import time


class SystemClock:
    """Seconds of the machine's monotonic clock, and a real sleep."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
