"""The processes a driver started (the Ray cluster of `ray.init()`, its agents, workers and engines), recorded while
the driver lives. So they can be stopped after it dies without a shutdown of its own.

A SIGKILLed driver runs no clean-up: its Ray head goes, but Ray's dashboard and runtime-env agents live on, and
nothing else names them. The driver writes RUN/ray_processes.json (PID, start time, name of each descendant); the run
scripts stop what is left of it after the driver exits, and so can a user:

    python -m slime_search.ray.session stop RUN/ray_processes.json

Only a process with the recorded PID *and* start time is stopped, so a PID the system gave to another process since
is left alone; nothing is ever stopped by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RECORD_NAME = "ray_processes.json"


def started_processes() -> list[dict]:
    """Every living descendant of this process: {"pid", "create_time", "name"}."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append({"pid": child.pid, "create_time": child.create_time(), "name": child.name()})
        except psutil.NoSuchProcess:  # ended while the tree was walked
            continue
    return found


def record_started_processes(path: str | Path) -> int:
    """Write (atomically) this process's descendants to `path`, keeping those recorded before that still live: a
    process started earlier and since reparented is still ours. Returns how many are recorded."""
    path = Path(path)
    earlier = read_record(path)
    alive = {process.pid for process in recorded_alive(earlier)}
    by_pid = {record["pid"]: record for record in earlier if record["pid"] in alive}
    by_pid.update({p["pid"]: p for p in started_processes()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(by_pid.values(), key=lambda p: p["pid"]), indent=1))
    os.replace(tmp, path)
    return len(by_pid)


def read_record(path: str | Path) -> list[dict]:
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else []


def recorded_alive(records: list[dict]) -> list:
    """The recorded processes that still run as themselves (same PID and start time), as psutil processes."""
    import psutil

    alive = []
    for record in records:
        try:
            process = psutil.Process(record["pid"])
            if abs(process.create_time() - record["create_time"]) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


def stop_recorded(path: str | Path, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every recorded process still running as itself, SIGKILL those left after `grace_s`; the PIDs
    stopped."""
    import psutil

    processes = recorded_alive(read_record(path))
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=grace_s)
    return sorted(p.pid for p in processes)


def ray_tmp_dir() -> Path:
    """Ray's folder on this machine (as Ray finds it: RAY_TMPDIR, else TMPDIR, else /tmp)."""
    return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"


def init_address(timeout_s: float = 2.0) -> str | None:
    """What the driver passes to ray.init(): None (Ray's own search: RAY_ADDRESS, else the head `ray start` last
    started on this machine, else a new local cluster), or "local" when that head no longer answers. `ray start`
    leaves its address in RAY_TMP/ray_current_cluster and nothing removes it when the head stops; ray.init() would
    retry the dead head for many minutes instead of starting a cluster of its own."""
    import logging
    import socket

    if os.environ.get("RAY_ADDRESS"):
        return None
    address_file = ray_tmp_dir() / "ray_current_cluster"
    try:
        address = address_file.read_text().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError):
        logging.getLogger(__name__).warning(
            "%s names the Ray head %s, which does not answer (stopped?): starting a Ray cluster of this run's own "
            "(set RAY_ADDRESS to join a running one)",
            address_file,
            address,
        )
        return "local"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="stop the processes a dead driver left, from its record")
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop what is left of the recorded processes")
    stop.add_argument("record", help=f"the run folder's {RECORD_NAME} (or the run folder)")
    stop.add_argument("--grace-s", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    path = Path(args.record)
    if path.is_dir():
        path = path / RECORD_NAME
    if not path.exists():
        print(f"no record at {path}: nothing to stop", file=sys.stderr)
        return 0
    stopped = stop_recorded(path, args.grace_s)
    print(f"stopped {len(stopped)} process(es) left by the driver: {stopped}" if stopped else "nothing left to stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
