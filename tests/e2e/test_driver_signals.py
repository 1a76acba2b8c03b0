"""A run stopped by SIGTERM or SIGINT to the driver's PID alone leaves no process behind: the driver shuts down its
engines, its Ray actors and the Ray cluster it started (raylet, GCS, agents, workers)."""

import contextlib
import signal
import subprocess
import time

import psutil
import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.utils.net import free_port
from tests.e2e.test_train_e2e import prepare_task, tiny_train_command
from tests.process_helpers import descendants, named

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def wait_for_first_step(run, proc, timeout_s: float = 300) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().strip():
            return
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"no step logged within {timeout_s} s")


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_driver_alone_stops_every_process_it_started(tiny_checkpoint, tmp_path, signum):
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        command = tiny_train_command(tiny_checkpoint, tmp_path, retriever.url, "--num-rollout", "1000")
        with open(tmp_path / "log.txt", "w") as log:
            # its own session, so the test can clean up by process group whatever outlives the driver; launched with
            # SIGINT ignored, as a background job of a non-interactive shell is (the driver must answer it anyway)
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore_sigint
            )
        started = []
        try:
            wait_for_first_step(run, proc)
            started = descendants(proc.pid)
            names = [name for _, name in named(started)]
            assert any("raylet" in name for name in names), names
            proc.send_signal(signum)  # the driver's PID only, not its process group
            proc.wait(timeout=120)
            _, alive = psutil.wait_procs(started, timeout=30)
            left = [f"{pid} {name}" for pid, name in named(alive)]
        finally:
            for process in [*descendants(proc.pid), *started]:  # never leak what this test started
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            if proc.poll() is None:
                proc.kill()
    assert left == [], f"{len(left)} of {len(started)} processes outlived the driver: {left}"
    assert proc.returncode != 0  # a stopped run does not claim success


def test_a_sigterm_to_the_run_script_stops_its_driver_and_services(tmp_path):
    """The script's trap forwards the signal to the driver at once (it runs in the background) and then stops the
    retriever and demonstrator it started: nothing the script started outlives it."""
    from tests.conftest import REPO_ROOT

    run = tmp_path / "mini"
    env = {
        **__import__("os").environ,
        "RUN_DIR": str(run),
        "PEOPLE": "60",
        "COMPANIES": "20",
        "HELDOUT": "8",
        "PRETRAIN_STEPS": "2",
        "SFT_STEPS": "1000",
        "RETRIEVER_PORT": str(free_port()),
        "DEMO_PORT": str(free_port()),
    }
    script = REPO_ROOT / "examples" / "search-r1" / "run_miniature_cpu.sh"
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(["bash", str(script)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    started = []
    try:
        wait_for_first_step(run / "sft", proc)
        started = descendants(proc.pid)
        names = " ".join(command for _, command in named(started, command_line=True))
        assert "retrieval_server" in names and "demonstrator" in names and "raylet" in names
        proc.send_signal(signal.SIGTERM)  # the script's PID only
        proc.wait(timeout=120)
        _, alive = psutil.wait_procs(started, timeout=30)
        left = [f"{pid} {name}" for pid, name in named(alive)]
    finally:
        for process in [*descendants(proc.pid), *started]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if proc.poll() is None:
            proc.kill()
    assert left == [], f"{len(left)} of {len(started)} processes outlived the script: {left}"
    assert proc.returncode == 130
