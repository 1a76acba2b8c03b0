"""What a SIGKILLed driver leaves running is stopped from its record, by PID and start time, and nothing else is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from slime_search.ray.session import main, read_record, recorded_alive, stop_recorded
from tests.process_helpers import named

# A stand-in driver: starts a child that outlives it, records its descendants, says so, and waits to be killed.
DRIVER = textwrap.dedent(
    """
    import subprocess, sys, time
    from slime_search.ray.session import record_started_processes
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(record_started_processes(sys.argv[1]), child.pid, flush=True)
    time.sleep(600)
    """
)


def start_and_kill_driver(record, script: str = DRIVER, timeout_s: float = 60.0) -> str:
    driver = subprocess.Popen([sys.executable, "-c", script, str(record)], stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line, f"the driver exited ({driver.wait(timeout_s)}) before recording"
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout_s)
    return line


def test_a_killed_drivers_child_lives_on_and_is_stopped_from_the_record(tmp_path):
    record = tmp_path / "ray_processes.json"
    count, child_pid = map(int, start_and_kill_driver(record).split())
    assert count == 1 and [p["pid"] for p in read_record(record)] == [child_pid]
    assert psutil.pid_exists(child_pid)  # the driver's death did not end it
    assert stop_recorded(record, grace_s=5) == [child_pid]
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    assert stop_recorded(record, grace_s=5) == []  # a second stop finds nothing


def test_a_second_record_keeps_the_earlier_processes_that_still_live(tmp_path):
    """The driver records twice (after Ray starts, after the engines start): a process of the first record that has
    left the driver's tree since (reparented) stays in the record; one that ended is dropped."""
    from slime_search.ray.session import record_started_processes

    record = tmp_path / "ray_processes.json"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    created = psutil.Process().create_time()  # a live process, though not a descendant: ours, the test's
    record.write_text(json.dumps([
        {"pid": os.getpid(), "create_time": created, "name": "earlier"},
        {"pid": gone.pid, "create_time": 0.0, "name": "ended"},
    ]))  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record_started_processes(record)
        pids = {r["pid"] for r in read_record(record)}
        assert os.getpid() in pids and child.pid in pids and gone.pid not in pids
    finally:
        child.kill()
        child.wait()


def test_a_pid_with_another_start_time_is_not_stopped(tmp_path):
    """The system may give a recorded PID to a new process: only the recorded start time identifies ours."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        created = psutil.Process(other.pid).create_time()
        record = tmp_path / "ray_processes.json"
        record.write_text(json.dumps([{"pid": other.pid, "create_time": created - 100.0, "name": "python"}]))
        assert recorded_alive(read_record(record)) == []
        assert stop_recorded(record, grace_s=1) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_command_takes_a_run_folder_and_says_when_there_is_no_record(tmp_path, capsys):
    assert main(["stop", str(tmp_path)]) == 0
    assert "no record" in capsys.readouterr().err


def alive_and_named(record) -> list[tuple[int, str]]:
    return named(recorded_alive(read_record(record)))


@pytest.mark.slow
def test_ray_agents_left_by_a_killed_driver_are_stopped_from_its_record(tmp_path):
    """The driver's own `ray.init()`: after SIGKILL, Ray's agents outlive it; the record names them and stop ends
    every one."""
    script = textwrap.dedent(
        """
        import sys, time
        import ray
        from slime_search.ray.session import record_started_processes
        ray.init(include_dashboard=False, num_cpus=1)
        time.sleep(3)  # the raylet starts its agents just after ray.init returns
        print(record_started_processes(sys.argv[1]), flush=True)
        time.sleep(600)
        """
    )
    record = tmp_path / "ray_processes.json"
    start_and_kill_driver(record, script, timeout_s=120)
    deadline = time.monotonic() + 30  # the head (GCS, raylet) and the workers go with the driver: give them time
    while time.monotonic() < deadline and any(
        name in process_name for _, process_name in alive_and_named(record)
        for name in ("raylet", "gcs_server", "worker")
    ):  # fmt: skip
        time.sleep(0.5)
    survivors = alive_and_named(record)
    print("left after the driver's SIGKILL:", survivors)
    assert survivors, "Ray stopped every process itself; the record is no longer needed for a killed driver"
    stopped = stop_recorded(record, grace_s=10)
    # A helper of the head (a plain `python` process of Ray's) may end by itself between the two looks, so stop
    # owes only what is still running then; the agents outlive a dead head and are stop's to end.
    assert set(stopped) <= {pid for pid, _ in survivors}
    agents = {pid for pid, name in survivors if "Agent" in name}
    assert agents and agents <= set(stopped)
    assert recorded_alive(read_record(record)) == []


def test_the_run_scripts_stop_what_a_killed_driver_left(tmp_path):
    """common.sh's run_driver: the driver (here one that records a child and SIGKILLs itself) dies with no shutdown;
    the script stops the child from the record in the driver's --save folder and returns the driver's status."""
    common = Path(__file__).resolve().parents[2] / "examples" / "search-r1" / "common.sh"
    driver = textwrap.dedent(
        """
        import os, signal, subprocess, sys
        from slime_search.ray.session import record_started_processes
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        record_started_processes(os.path.join(sys.argv[2], "ray_processes.json"))
        print(child.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    script = f'source "{common}"\nrun_driver "{sys.executable}" -c "$DRIVER" --save "{tmp_path}"\necho "status $?"\n'
    done = subprocess.run(
        ["bash", "-c", script], env={**os.environ, "DRIVER": driver}, capture_output=True, text=True, timeout=120
    )
    child_pid = int(done.stdout.split()[0])
    assert done.stdout.split()[-2:] == ["status", str(128 + signal.SIGKILL)], done.stdout + done.stderr
    assert "stopped 1 process(es)" in done.stdout
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_run_scripts_ray_head_answers_where_a_token_exists_and_is_forgotten_once_stopped(tmp_path):
    """common.sh's start_ray_head where an earlier ray.init() left ~/.ray/auth_token: Ray turns token authentication on
    for the head, so `ray status` and a driver must send the token; the head answers both. When the script ends it
    stops the head (by PID) and removes the address `ray start` left for later ray.init() calls to join."""
    import tempfile

    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    from slime_search.utils.net import free_port

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(generate_new_authentication_token())
    # Ray's own folder for this head, short (its socket paths must fit) and apart from /tmp/ray: while the head runs,
    # no ray.init() of another test may find its address there and join it
    ray_tmp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    common = Path(__file__).resolve().parents[2] / "examples" / "search-r1" / "common.sh"
    driver = "import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU'])"
    script = (
        f'source "{common}"\nstart_ray_head {free_port()} 0 "{tmp_path}/head.log" || exit 1\n'
        f'"{sys.executable}" -c "{driver}"\n'
        f'test -f "{ray_tmp}/ray/ray_current_cluster" && echo "address written"\n'  # once the head is up, not before
        f'echo "head ${{STARTED_PIDS[0]}}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"HOME": str(tmp_path), "RAY_TMPDIR": str(ray_tmp)}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "head.log").read_text()[-2000:]
    assert "Ray head (pid" in done.stdout and "cpus " in done.stdout and "address written" in done.stdout
    head = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 30  # the script's EXIT trap stopped the head (SIGTERM, by PID)
    while psutil.pid_exists(head) and psutil.Process(head).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the Ray head outlived the script that started it"
        time.sleep(0.5)
    assert not (ray_tmp / "ray" / "ray_current_cluster").exists()


def test_the_driver_joins_a_head_ray_start_left_only_while_it_answers(tmp_path, monkeypatch, caplog):
    """`ray start` leaves its head's address in RAY_TMP/ray_current_cluster; ray.init() with no address joins it, and
    retries for minutes once that head has stopped. The driver starts a cluster of its own then, and says why."""
    import socket

    from slime_search.ray.session import init_address
    from slime_search.utils.net import free_port

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert init_address() is None  # no head was started here: Ray starts a local cluster
    (tmp_path / "ray").mkdir()
    address_file = tmp_path / "ray" / "ray_current_cluster"
    with socket.create_server(("127.0.0.1", 0)) as head:
        address_file.write_text(f"127.0.0.1:{head.getsockname()[1]}\n")
        assert init_address() is None  # a head that answers is joined, as Ray would
    address_file.write_text(f"127.0.0.1:{free_port()}")
    with caplog.at_level("WARNING"):
        assert init_address(timeout_s=0.5) == "local"
    assert "does not answer" in caplog.text and str(address_file) in caplog.text
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert init_address() is None  # RAY_ADDRESS names the cluster: Ray's to use, checked or not
