"""An engine killed during a run costs no step: its trajectories move to the other engine, the dead engine is found
after the rollout, started again on its address while the actor trains, and takes the next weight push with the other
(every push checks that every engine serves the new version, and every rollout that all its turns saw one version)."""

import contextlib
import json
import signal
import subprocess

import psutil
import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from tests.e2e.test_driver_signals import wait_for_first_step
from tests.e2e.test_train_e2e import prepare_task, tiny_train_command
from tests.process_helpers import descendants, named

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def cpu_engines(pid: int) -> list[psutil.Process]:
    children = descendants(pid)
    engine_pids = {pid for pid, command in named(children, command_line=True) if "cpu_engine_server" in command}
    return [p for p in children if p.pid in engine_pids]


def test_an_engine_killed_mid_run_is_restarted_and_the_run_completes(tiny_checkpoint, tmp_path):
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        command = tiny_train_command(
            tiny_checkpoint, tmp_path, retriever.url,
            "--num-rollout", "4", "--cpu-engines", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "48", "--max-response-tokens", "96", "--engine-health-timeout", "20",
        )  # fmt: skip
        with open(tmp_path / "log.txt", "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_first_step(run, proc)
            engines = cpu_engines(proc.pid)
            assert len(engines) == 2
            engines[1].send_signal(signal.SIGKILL)  # one of the two engines this test's run started
            returncode = proc.wait(timeout=600)
        finally:
            for process in descendants(proc.pid):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            if proc.poll() is None:
                proc.kill()
    assert returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in train] == [1, 2, 3, 4]  # every engine served it after each push
    assert sum(r["engines/restarted"] for r in train) == 1
    assert all(r["rollout/engine_errors"] == 0 for r in train)  # no trajectory was lost to the dead engine
    restarted = next(r for r in train if r["engines/restarted"])
    assert restarted["time/engine_restart_wait_s"] >= 0
    assert [r["rollout/weight_version"] for r in train] == [0, 1, 2, 3]
    assert "serving on" in next(run.glob("engine-*.restart1.log")).read_text()
