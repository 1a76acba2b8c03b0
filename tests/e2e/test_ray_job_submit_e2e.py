"""slime's launch shape (examples/search-r1/run_qwen2.5_3B.sh at slime 624b824): the user starts a Ray head
(`ray start --head`) and submits the driver to it as a Ray job (`ray job submit --runtime-env-json '{"env_vars":
{"PYTHONPATH": ...}}' -- python3 train.py ...`) from the checkout's root. Two GRPO steps on CPU with slime's own
generate_with_search, found only through the job's PYTHONPATH: the driver joins that head (no cluster of its own), the
rollout manager actor loads the plugin, and the head and another job on it outlive the driver's shutdown."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.ray.session import RECORD_NAME, read_record
from slime_search.utils.net import free_port
from tests.compat.conftest import SEARCH_R1, require_slime_files
from tests.conftest import REPO_ROOT
from tests.e2e.test_slime_plugin_e2e import CONFIG_MODULE
from tests.e2e.test_train_e2e import prepare_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))


def require_job_server() -> None:
    """`ray job submit` needs the job server of `pip install "ray[default]"`; the minimal ray has none."""
    from ray._private.utils import get_dashboard_dependency_error

    if get_dashboard_dependency_error() is not None:
        pytest.skip('ray job submit needs the job server: pip install "ray[default]"')


SLEEPER = "import time; time.sleep(600)"  # another user's job on the same head


def head_env(ray_tmp: Path) -> dict[str, str]:
    """The environment of the head and of the `ray job` commands: no RAY_ADDRESS of the caller's, Ray's folder of its
    own (its ray_current_cluster is then seen by no ray.init() elsewhere on the machine), no PYTHONPATH (the plugin
    must come from the job's runtime env). Ray 2.60 turns token authentication on for a head where a token exists,
    and its CLI sends the token only when RAY_AUTH_MODE says so (as examples/search-r1/common.sh does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    env["RAY_TMPDIR"] = str(ray_tmp)
    if os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").is_file():
        env["RAY_AUTH_MODE"] = "token"
    return env


def wait_listening(ports: list[int], head: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the Ray head is not up on port {port}: {log.read_text()[-3000:]}") from None
                time.sleep(0.5)


def stop_processes(processes: list[psutil.Process], grace_s: float = 5) -> None:
    """SIGTERM to all at once, SIGKILL to those left after `grace_s`; psutil refuses a PID that another process has
    taken since."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@pytest.fixture
def ray_head(tmp_path):
    """A head as slime's script starts it (on 127.0.0.1, free ports, 4 CPUs), started from the checkout's root: the
    jobs' entrypoints run in the folder the head was started in. `--block` keeps its processes under one PID; they
    are stopped by that PID and its descendants' (all at once: the head alone waits ~30 s on its jobs' workers), never
    by `ray stop`, which stops every Ray on the machine."""
    require_slime_files()
    require_job_server()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))  # short: Ray's socket paths must fit
    gcs, dashboard, agent = free_port(), free_port(), free_port()
    log = tmp_path / "head.log"
    command = [
        RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
        "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port", str(agent), "--num-cpus", "4",
        "--disable-usage-stats",
    ]  # fmt: skip
    env = head_env(ray_tmp)
    with log.open("w") as out:
        head = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_listening([gcs, dashboard, agent], head, log)  # the agent's port: the job server on the head node
        yield {"url": f"http://127.0.0.1:{dashboard}", "env": env, "process": head}
    finally:
        if head.poll() is None:
            own = psutil.Process(head.pid)
            stop_processes([own, *own.children(recursive=True)])
        head.wait(60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def ray_cli(head, *command: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`ray GROUP COMMAND --address HEAD ARGS...`: the address before a submitted entrypoint's `--`."""
    command = [*command[:2], "--address", head["url"], *command[2:]]
    return subprocess.run(
        [RAY, *command], cwd=REPO_ROOT, env=head["env"], capture_output=True, text=True, timeout=timeout_s
    )


def ray_job(head, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return ray_cli(head, "job", *args, timeout_s=timeout_s)


def submit_other_job(head, timeout_s: float = 120) -> None:
    """Another user's job on the head, submitted once the job server has found the head node's agent (until then it
    answers "No available agent")."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = ray_job(head, "submit", "--no-wait", "--submission-id", "other", "--", "python3", "-c", SLEEPER)
        if done.returncode == 0:
            return
        assert "No available agent" in done.stderr and time.monotonic() < deadline, done.stdout + done.stderr
        time.sleep(1)


def test_the_driver_runs_as_a_ray_job_on_the_users_head(ray_head, tiny_checkpoint, tmp_path):
    require_slime_files()
    submit_other_job(ray_head)
    plugin_folder = tmp_path / "plugins"  # reached by the job's PYTHONPATH only
    plugin_folder.mkdir()
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        (plugin_folder / "slime_search_config.py").write_text(CONFIG_MODULE.format(url=f"{retriever.url}/retrieve"))
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(map(str, [plugin_folder, SEARCH_R1, REPO_ROOT]))}}
        done = ray_job(
            ray_head, "submit", "--runtime-env-json", json.dumps(runtime_env), "--",
            "python3", "train.py",
            "--hf-checkpoint", str(tiny_checkpoint), "--save", str(run),
            "--prompt-data", str(tmp_path / "train.parquet"), "--input-key", "prompt", "--label-key", "reward_model",
            "--apply-chat-template", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--lr", "1e-2",
            "--custom-generate-function-path", "slime_search_config.generate",
            "--custom-rm-path", "slime_search_config.reward_func",
            timeout_s=500,
        )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output[-5000:]
    # the driver joined the user's head: its rollout manager was an actor there, and the processes the driver started
    # (its record) hold no GCS or raylet of a cluster of its own
    actors = ray_cli(ray_head, "list", "actors", "--filter", "class_name=RolloutManager")
    assert "RolloutManager" in actors.stdout, actors.stdout + actors.stderr
    assert (run / RECORD_NAME).is_file()
    own = {record["name"] for record in read_record(run / RECORD_NAME)}
    assert not own & {"gcs_server", "raylet"}, own
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["weight_version"] for r in train] == [1, 2]
    assert all(r["rollout/trainable"] == 4.0 and r["rollout/failed"] == 0.0 for r in train)
    # slime's plugin ran in the rollout manager actor, imported through the job's PYTHONPATH
    assert "slime is not installed" in (run / "rollout_manager.log").read_text()
    # the driver's shutdown left the head, and the other job on it, running
    assert ray_head["process"].poll() is None
    status = ray_job(ray_head, "status", "other")
    assert status.returncode == 0 and "RUNNING" in status.stdout + status.stderr, status.stdout + status.stderr
