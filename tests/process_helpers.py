"""Looking at processes that may end while they are looked at: a test that lists what a run started and then asks each
for its name must leave out one that ended in between, not fail on it."""

from __future__ import annotations

import contextlib

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def named(processes: list[psutil.Process], command_line: bool = False) -> list[tuple[int, str]]:
    """(PID, name) of each process still running, or (PID, whole command line); one that has ended is left out."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # ZombieProcess is one too
            found.append((process.pid, " ".join(process.cmdline()) if command_line else process.name()))
    return found
