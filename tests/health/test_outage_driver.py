"""Faults that pass, through the real driver loop (run.loop.run_steps), guard, recovery and run folder, with the real
RolloutManager as a Ray actor generating from a real retriever (the BM25 server on 127.0.0.1) that goes down and comes
back; the actor's group is simulated (no model) and time runs on a clock of the test's, so a 10-minute outage takes no
time. A retriever outage is waited out in every --async-mode and the step trained once it is back; one that outlasts
--health-max-outage-hours stops the run on its newest checkpoint, and the same command resumes it; a --save disk that
is full is waited out the same way, nothing lost meanwhile."""

from __future__ import annotations

import errno
import json
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.health.events import OUTAGE
from slime_search.ray.train_group import ModelSource
from slime_search.utils.server_process import ServerProcess
from tests.health.outage_plugins import row_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPTS, BATCH = 4, 2  # prompts in the file (tests.e2e.test_train_e2e.prepare_task), prompts per step


class Retriever:
    """The BM25 retriever on one address for the whole module, started and stopped as a test needs."""

    def __init__(self, args: list[str], port: int):
        self.args, self.port, self.process = args, port, None
        self.url = f"http://127.0.0.1:{port}"

    def up(self) -> None:
        if self.process is None:
            self.process = RetrievalServerProcess(*self.args, "--port", str(self.port))

    def down(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


class OutageClock:
    """The run's clock (now, sleep) in simulated seconds; `back_at`: when the retriever comes back (started during
    the sleep that passes it)."""

    def __init__(self, retriever: Retriever, back_at: float | None = None):
        self.t, self.retriever, self.back_at, self.sleeps = 0.0, retriever, back_at, []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        if self.back_at is not None and self.t >= self.back_at:
            self.retriever.up()


class SimGroup:
    """The actor's ranks without a model: what it trained on (the prompt rows, per step), checkpoints as folders of
    the real layout; `after_step(k)` is called once step k trained (to take the retriever down)."""

    def __init__(self, after_step=None):
        self.trained, self.after_step, self.lr_scales, self.saved = [], after_step or (lambda step: None), [], []

    def prepare(self, samples) -> None:
        for sample in samples:
            sample.old_log_probs = [-1.0] * sample.response_length

    def optimize(self, samples, steps: int, skip_above=None) -> dict[str, float]:
        self.trained.append(sorted({row_of(s.tokens) for s in samples}))
        self.after_step(len(self.trained) - 1)
        return {"train/loss": 0.1, "train/grad_norm": 0.5, "train/grad_norm_max": 0.5, "train/steps": 1.0,
                "train/steps_applied": 1.0, "train/entropy": 1.0, "train/kl_old_new": 0.01, "train/lr": 1e-3}  # fmt: skip

    def save(self, root: str, steps_done: int, files: dict[str, str]) -> None:
        from slime_search.backends.megatron.checkpoint import TRACKER, iteration_dir

        folder = iteration_dir(root, steps_done)
        folder.mkdir(parents=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        (Path(root) / TRACKER).write_text(str(steps_done))
        self.saved.append(steps_done)

    def load(self, root: str, steps_done: int) -> None:
        self.loaded = steps_done

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scales.append(scale)

    def shutdown(self) -> None:
        """Nothing runs."""


class FullDisk:
    """The group, with its first `times` saves of `steps_done` failing as a full disk fails one: part of the partial
    folder written, then OSError ENOSPC. Only `save` is changed; `left` must reach 0 (every failure met by a retry),
    else the test fails: the product does not rely on the wrapper, it is the wrapper that checks the product."""

    def __init__(self, group: SimGroup, steps_done: int, times: int):
        self.group, self.steps_done, self.left = group, steps_done, times

    def save(self, root: str, steps_done: int, files: dict[str, str]) -> None:
        from slime_search.backends.megatron.checkpoint import partial_dir

        if steps_done == self.steps_done and self.left:
            self.left -= 1
            partial_dir(root, steps_done).mkdir(parents=True, exist_ok=True)
            (partial_dir(root, steps_done) / "model.distcp").write_bytes(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
        self.group.save(root, steps_done, files)

    def __getattr__(self, name):
        return getattr(self.group, name)


class NoEval:
    def results(self, step):
        return []

    def pending_versions(self):
        return set()

    def metrics(self):
        return {}

    def rolled_back(self, to_step):
        pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Ray, the retriever (up) and one RolloutManager actor searching it, with the outage plugins."""
    ray = pytest.importorskip("ray")
    from slime_search.engines.deployment import EngineConfig
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import RolloutManager, RolloutManagerConfig
    from slime_search.rollout.rollout import RolloutConfig
    from slime_search.utils.net import free_port
    from tests.e2e.test_train_e2e import prepare_task

    folder = tmp_path_factory.mktemp("outage")
    retriever = Retriever(prepare_task(folder), free_port())
    retriever.up()
    engine = ServerProcess([str(Path(__file__).parent / "reward_service.py")])  # answers a push's pause, no model
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    config = RolloutManagerConfig(
        engines=EngineConfig(model_path="", engine_url=engine.url),  # the plugins generate without an engine
        data=DataConfig(path=str(folder / "train.parquet")),
        rollout=RolloutConfig(batch_size=BATCH, n_samples_per_prompt=2),
        generate_path="tests.health.outage_plugins.search_once",
        reward_path="tests.health.outage_plugins.alternating_reward",
        log_dir=str(folder),
    )
    plugin_args = Namespace(search_url=f"{retriever.url}/retrieve")
    manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=4).remote(config, plugin_args)
    try:
        yield SimpleNamespace(ray=ray, retriever=retriever, manager=manager)
    finally:
        ray.get(manager.shutdown.remote())
        ray.shutdown()
        retriever.down()
        engine.stop()


def run_config(run_dir: Path, mode: str, steps: int, health):
    from slime_search.evaluation.subsets import EvalSubset
    from slime_search.rollout.schedule import ScheduleConfig
    from slime_search.run.config import RunConfig

    return RunConfig(
        run_dir=str(run_dir), num_rollout=steps, save_interval=1, keep_checkpoints=0, save_hf=False, eval_interval=0,
        log_rollout_examples=0, colocate=False, serves_policy=True, steps_per_rollout=1, train_group=None,
        model=ModelSource("hf"), actor=SimpleNamespace(loss=SimpleNamespace(uses_old_log_probs=True,
        tis_cap=2.0, mis=None)), rollout=SimpleNamespace(eval_sets=[], eval_subset=EvalSubset()), weight_sync=None,
        schedule=ScheduleConfig(mode), wandb=(False, "", None), health=health,
    )  # fmt: skip


def train(world, run_dir: Path, group, clock, mode="off", steps=3, argv=("--x",), checkpoint_bytes=None, **health):
    """The driver's run: resume from the run folder, run the steps; returns the handles and the stop, if any. The
    manager starts each run at the data position of the run folder (or the file's start). `checkpoint_bytes`: the
    size of one checkpoint, as run.parts.open_parts measures it (None: not known)."""
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard, RunStopped
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.rollout.schedule import create_schedule
    from slime_search.run.folder import RunFolder
    from slime_search.run.loop import run_steps
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery

    world.ray.get(world.manager.load_state_dict.remote({"data": {"epoch": 0, "offset": 0}}))
    config = run_config(run_dir, mode, steps, HealthConfig(**health))
    run = RunFolder(config.run_dir)
    parts = RunParts(
        config, run, MetricsSink(run.path), group, HealthGuard(config.health), world.manager, None,
        Colocation(False, group, world.manager), NoEval(), create_schedule(config.schedule, world.manager),
        clock=clock, checkpoint_bytes=checkpoint_bytes,
    )  # fmt: skip
    recovery, stopped = Recovery(parts, list(argv)), None
    try:
        run_steps(parts, recovery, recovery.resume())
    except RunStopped as err:
        stopped = str(err)
    finally:
        parts.schedule.stop()
        parts.sink.close()
    return parts, stopped


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "time/step_s" in record]


@pytest.mark.parametrize("mode", ["off", "one-step", "fully"])
def test_a_ten_minute_retriever_outage_is_waited_out_and_the_step_trained_once_it_is_back(world, tmp_path, mode):
    world.retriever.down()
    clock = OutageClock(world.retriever, back_at=600.0)
    group = SimGroup()
    parts, stopped = train(world, tmp_path / "run", group, clock, mode)
    assert stopped is None
    # tries at 0, 15, 45, 105, 225 and 465 s fail; the one at 765 s finds the retriever back
    assert clock.sleeps == [15, 30, 60, 120, 240, 300]
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and len(group.trained) == 3  # every step trained, once
    assert records[0]["health/paused_s"] == 765 and records[0]["health/pauses"] == 6
    assert records[1]["health/paused_s"] == 0 and records[0]["rollout/search_failures"] == 0
    pauses = [e for e in parts.folder.events() if e["action"] == "pause"]
    assert [e["values"][OUTAGE] for e in pauses] == [0, 15, 45, 105, 225, 465]
    assert {(e["step"], e["rule"]) for e in pauses} == {(0, "search_failures")}
    assert world.retriever.url in pauses[0]["message"] and "waiting 15 s and trying again" in pauses[0]["message"]
    assert not [e for e in parts.folder.events() if e["action"] in ("skip", "stop", "rollback")]
    if mode == "off":  # each failed try passed over its batch's prompts; the steps took theirs in the file's order
        taken = [[(2 * k) % PROMPTS, (2 * k + 1) % PROMPTS] for k in range(9)]
        assert group.trained == taken[6:]
    state = json.loads((parts.folder.checkpoints / "iter_0000003" / "rollout_state.json").read_text())["data"]
    taken_prompts = state["epoch"] * PROMPTS + state["offset"] - len(state["given_back"])
    assert taken_prompts == 9 * BATCH  # 3 steps and 6 failed tries: nothing else was drawn, nothing given back twice


def test_an_outage_past_the_limit_stops_on_the_newest_checkpoint_and_the_same_command_resumes(world, tmp_path):
    """Steps 0 and 1 train; the retriever goes down after step 1 and stays down past --health-max-outage-hours 0.1
    (6 minutes): the run stops at step 2 on checkpoint 2, the newest, though not yet confirmed (the guard's rollback
    target would be checkpoint 0); run again unchanged with the retriever back, it resumes there and finishes."""
    world.retriever.up()
    run = tmp_path / "run"
    group = SimGroup(after_step=lambda step: world.retriever.down() if step == 1 else None)
    clock = OutageClock(world.retriever)
    parts, stopped = train(world, run, group, clock, steps=4, max_outage_hours=0.1)
    assert stopped is not None and "past --health-max-outage-hours 0.1" in stopped
    assert "once the retriever behind --search-url answers again" in stopped and "run the same command" in stopped
    assert clock.sleeps == [15, 30, 60, 120, 135] and len(group.trained) == 2
    [stop] = [e for e in parts.folder.events() if e["action"] == "stop"]
    assert stop["step"] == 2 and stop["values"]["ended_on"] == 2 and stop["values"][OUTAGE] == 360
    assert "the run ends on the checkpoint of step 2 (the newest: the weights are not at fault)" in stop["message"]
    assert (
        parts.guard.policy.stop_target(parts.folder.checkpoint_steps(), 2) == 0
    )  # where a stop of the policy would go
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 2 and final["checkpoint"] == "checkpoints/iter_0000002"
    assert json.loads((run / "stopped.json").read_text())["transient"] is True
    assert parts.folder.checkpoint_steps() == [0, 1, 2] and parts.folder.undone_checkpoints() == []
    from slime_search.run.recovery import repeated_stop

    assert repeated_stop(run, ["--x"]) is None and not (run / "stopped.json").exists()  # the same command goes on
    world.retriever.up()
    resumed = SimGroup()
    parts, stopped = train(world, run, resumed, OutageClock(world.retriever), steps=4, max_outage_hours=0.1)
    assert stopped is None and len(resumed.trained) == 2
    assert [r["step"] for r in step_records(run)] == [0, 1, 2, 3]
    assert json.loads((run / "final.json").read_text())["step"] == 4


@pytest.mark.parametrize("fails", [2, 100])
def test_a_full_save_disk_is_waited_out_with_nothing_lost(world, tmp_path, fails):
    """The save of checkpoint 2 finds the disk full: the partial folder goes, checkpoints 0 and 1 and the tracker stay,
    the run says how much room one checkpoint needs and where, and saves again after 15 s, 30 s...: the third try
    saves it and the run goes on; a disk that stays full stops the run past --health-max-outage-hours on checkpoint 1,
    resumable."""
    from slime_search.backends.megatron.checkpoint import latest_iteration, partial_dir

    world.retriever.up()
    run = tmp_path / "run"
    full = FullDisk(SimGroup(), steps_done=2, times=fails)
    seen = []

    class Watching(OutageClock):
        def sleep(self, seconds):  # what the disk holds while the run waits
            seen.append(
                (sorted(p.name for p in (run / "checkpoints").iterdir()), latest_iteration(run / "checkpoints"))
            )
            super().sleep(seconds)

    clock = Watching(world.retriever)
    parts, stopped = train(world, run, full, clock, steps=3, max_outage_hours=0.1, checkpoint_bytes=10**6)
    assert all(s == (["iter_0000000", "iter_0000001", "latest_checkpointed_iteration.txt"], 1) for s in seen)
    assert not partial_dir(run / "checkpoints", 2).exists()
    pauses = [e for e in parts.folder.events() if e["action"] == "pause"]
    assert pauses and {(e["step"], e["rule"]) for e in pauses} == {(1, "disk_full")}
    assert f"saving the checkpoint of step 2: the disk of --save {run} has no room for it" in pauses[0]["message"]
    assert "one checkpoint needs 0.0 GB, " in pauses[0]["message"]
    assert "GB are free there: free space on that disk, or keep fewer checkpoints" in pauses[0]["message"]
    if fails == 2:
        assert full.left == 0 and stopped is None and clock.sleeps == [15, 30]
        assert parts.folder.checkpoint_steps() == [0, 1, 2, 3] and [r["step"] for r in step_records(run)] == [0, 1, 2]
        return
    assert stopped is not None and "free space on the disk of --save" in stopped
    stop = json.loads((run / "stopped.json").read_text())
    assert stop["transient"] is True and stop["event"]["rule"] == "disk_full"
    assert json.loads((run / "final.json").read_text())["step"] == 1  # the newest checkpoint


def test_a_disk_without_room_for_one_checkpoint_is_found_before_the_save_starts(world, tmp_path):
    """Less room on the --save disk than one checkpoint needs: the ranks are not sent into the save (one of them would
    fail where the others wait); the run waits as for a save that failed, then stops on its newest checkpoint."""
    world.retriever.up()
    run = tmp_path / "run"
    group = SimGroup()
    parts, stopped = train(world, run, group, OutageClock(world.retriever), steps=2, max_outage_hours=0.01,
                       checkpoint_bytes=10**18)  # fmt: skip
    assert group.saved == [] and stopped is not None  # not even the starting weights could be saved
    [pause, *_, stop] = [e for e in parts.folder.events() if e["rule"] == "disk_full"]
    assert "one checkpoint needs 1000000000.0 GB" in pause["message"] and stop["action"] == "stop"
    assert json.loads((run / "final.json").read_text())["checkpoint"] is None


def test_a_full_disk_on_a_rank_reaches_the_driver_as_one(world):
    """What a rank raises (checkpoint._write_all: OSError ENOSPC) is found behind Ray's RayTaskError at the driver."""
    from slime_search.utils.faults import disk_full_error

    @world.ray.remote
    def save():
        raise OSError(errno.ENOSPC, "No space left on device writing the checkpoint of iteration 2 in /runs/x")

    with pytest.raises(Exception) as raised:  # noqa: PT011 - Ray's own class, made for the cause
        world.ray.get(save.remote())
    assert disk_full_error(raised.value).errno == errno.ENOSPC
