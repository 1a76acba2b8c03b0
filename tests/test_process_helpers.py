"""The helpers that name a run's processes leave out one that ended after it was listed, rather than fail on it."""

import subprocess
import sys
import time

import psutil

from tests.process_helpers import named


def test_a_process_that_ended_after_it_was_listed_is_left_out_and_the_living_are_named():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    listed = psutil.Process(ended.pid)  # listed while it ran, as a walk of a run's tree lists it
    ended.wait()
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Popen returns once the child is forked; until it has exec'd, its command line is not its own yet (read empty
        # under load in CI)
        deadline = time.monotonic() + 30
        while "time.sleep(60)" not in " ".join(psutil.Process(living.pid).cmdline()) and time.monotonic() < deadline:
            time.sleep(0.01)
        processes = [listed, psutil.Process(living.pid)]
        assert [pid for pid, _ in named(processes)] == [living.pid]
        ((_, command),) = named(processes, command_line=True)
        assert "time.sleep(60)" in command
    finally:
        living.kill()
        living.wait()
