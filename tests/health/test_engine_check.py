"""The guard and the recovery against engines that disagree with the trainer, through the real driver loop
(slime_search.run.loop.run_steps), run folder and weight-push path over a simulated actor and two engines (no model):
an engine off by 1.5 nats that a re-push and a restart do not cure stops the run on its newest checkpoint, naming the
engine; one a restart cures is restarted and the run goes on; a gap every engine's probe answers for as the policy's
is never rolled back; and in an asynchronous mode the gap of tokens sampled by older weights warns of nothing while a
stale engine is still caught by the probe."""

import json
from types import SimpleNamespace

import pytest

from slime_search.health.config import HealthConfig
from slime_search.ray.train_group import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENGINES = ("http://engine-a", "http://engine-b")
SAMPLES, RESPONSE = 8, 5


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


class World:
    """The trainer's weights (a version and an accuracy), what each engine serves, and the engines' faults: `off`
    (url -> nats every log-prob of it is off, from step `since`; `cured_by_restart` whether a restart removes it),
    `stale_from` (the engines keep the weights they had from that version on: a lost update), `policy_gap` (the
    rollout log-probs differ from the trainer's by this on every engine: tokens of older weights, not an engine)."""

    def __init__(self, off=None, since=0, cured_by_restart=False, stale_from=None, policy_gap=0.0, started=True):
        self.off, self.since, self.cured_by_restart = dict(off or {}), since, cured_by_restart
        self.started = started  # whether the run started the engines (else they are given by address)
        self.stale_from, self.policy_gap = stale_from, policy_gap
        self.step = 0
        self.trained = 0  # the trainer's version: updates applied
        self.served = dict.fromkeys(ENGINES, 0)
        self.restarted: list[str] = []
        self.pushes: list[str] = []

    def engine_offset(self, url: str) -> float:
        offset = self.off.get(url, 0.0) if self.step >= self.since else 0.0
        return offset + 0.01 * (self.trained - self.served[url])  # weights a version behind: 0.01 nats each

    def accuracy(self, version: int) -> float:
        return min(0.95, 0.1 + 0.1 * version)


def trainer_side(tokens: list[int]) -> list[float]:
    return [-1.0 - 0.01 * (token % 7) for token in tokens[1:]]


class Manager:
    """The RolloutManager's calls the driver, the schedules and the recovery make."""

    def __init__(self, world: World):
        self.world, self.stream_version = world, 0

    def _batch(self, version_lag: int):
        from slime_search.rollout.manager import RolloutBatch
        from slime_search.types import TrainSample

        w = self.world
        samples = []
        for i in range(SAMPLES):
            url = ENGINES[i % 2]
            gap = w.engine_offset(url) + w.policy_gap
            rollout = [lp - gap for lp in trainer_side(list(range(10, 10 + RESPONSE + 1)))]
            versions = [w.trained - version_lag] * RESPONSE
            samples.append(TrainSample(list(range(10, 20)), RESPONSE, [1] * RESPONSE, 0.5 - (i % 2), rollout, None))
            samples[-1].token_versions = versions
        metrics = {
            "rollout/samples": float(SAMPLES), "rollout/trainable": float(SAMPLES), "rollout/reward_errors": 0.0,
            "rollout/reward_mean": 0.5, "rollout/response_length_p90": 100.0, "rollout/truncation_rate": 0.1,
            "rollout/zero_std_group_share": 0.3, "rollout/search_calls": 10.0, "rollout/search_failures": 0.0,
        }  # fmt: skip
        w.step += 1
        return RolloutBatch(samples, metrics, [], {})

    def generate(self, examples: int):
        return self._batch(version_lag=0)

    def start_stream(self, staleness, version, order):
        self.stream_version = version

    def next_batch(self, trainer_version, examples, max_token_lag):
        return self._batch(version_lag=1)  # one-step: every token one version behind the trainer's

    def drain(self):
        pass

    def set_policy_version(self, version):
        self.stream_version = version

    def stop_stream(self):
        pass

    def progress(self):
        return 1, 1

    def state_dict(self):
        return {"step": self.world.step}

    def load_state_dict(self, state):
        self.world.step = state["step"]

    def set_sampling_attempt(self, attempt):
        pass

    def engine_log_probs(self, token_ids):
        return {url: [lp - self.world.engine_offset(url) for lp in trainer_side(token_ids)] for url in ENGINES}

    def restart_engine(self, url):
        w = self.world
        if not w.started:
            raise ValueError(f"{url} is not an engine this run started")
        w.restarted.append(url)
        w.served[url] = 0  # it serves the checkpoint it was started from until it is pushed
        if w.cured_by_restart:
            w.off.pop(url, None)

    def wait_restarted_engines(self):
        return list(dict.fromkeys(self.world.restarted))

    def pause_generation(self, urls=None):
        pass

    def continue_generation(self, urls=None):
        pass


class Actor:
    """Ray's calling convention (`obj.method.remote(...)` -> an object ref) over a plain object."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        import ray

        method = getattr(self._target, name)
        return SimpleNamespace(remote=lambda *a, **k: ray.put(method(*a, **k)))


class Group:
    def __init__(self, world: World):
        self.world = world

    def prepare(self, samples):
        for sample in samples:
            sample.old_log_probs = trainer_side(list(range(10, 10 + RESPONSE + 1)))

    def optimize(self, samples, steps, skip_above=None):
        self.world.trained += 1
        return {"train/loss": 0.1, "train/grad_norm": 0.5, "train/grad_norm_max": 0.5, "train/steps": 1.0,
                "train/steps_applied": 1.0, "train/entropy": 1.0, "train/kl_old_new": 0.01}  # fmt: skip

    def trainer_log_probs(self, token_ids):
        return trainer_side(token_ids)

    def save(self, root, steps_done, files):
        from pathlib import Path

        from slime_search.backends.megatron.checkpoint import TRACKER, iteration_dir

        folder = iteration_dir(root, steps_done)
        folder.mkdir(parents=True)
        (folder / "weights.json").write_text(json.dumps(self.world.trained))
        for name, text in files.items():
            (folder / name).write_text(text)
        (Path(root) / TRACKER).write_text(str(steps_done))

    def load(self, root, steps_done):
        from slime_search.backends.megatron.checkpoint import iteration_dir

        self.world.trained = json.loads((iteration_dir(root, steps_done) / "weights.json").read_text())

    def set_lr_scale(self, scale):
        self.world.lr_scale = scale

    def shutdown(self):
        pass


class Push:
    """The weight push: every engine takes the trainer's weights, except that a stale engine keeps the ones it had."""

    def __init__(self, world: World):
        self.world = world

    def push(self, version: str) -> str:
        w = self.world
        w.pushes.append(version)
        for url in ENGINES:
            if w.stale_from is None or int(version) < w.stale_from:
                w.served[url] = w.trained
        return version

    def reconnect(self):
        pass


class Evaluator:
    def __init__(self, config, world):
        self.config, self.world = config, world

    def results(self, step):
        from slime_search.run.eval_engine import EvalResult

        if not self.config.eval_due(step):
            return []
        return [EvalResult(step, {"eval/score": self.world.accuracy(self.world.trained)}, [], {})]

    def pending_versions(self):
        return set()

    def metrics(self):
        return {}

    def rolled_back(self, to_step):
        pass


def run(tmp_path, world: World, steps=20, mode="off", **health):
    from slime_search.evaluation.subsets import EvalSubset
    from slime_search.health.guard import HealthGuard, RunStopped
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.rollout.schedule import ScheduleConfig, create_schedule
    from slime_search.run.config import RunConfig
    from slime_search.run.folder import RunFolder
    from slime_search.run.loop import run_steps
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery

    config = RunConfig(
        run_dir=str(tmp_path / "run"), num_rollout=steps, save_interval=5, keep_checkpoints=2, save_hf=False,
        eval_interval=5, log_rollout_examples=0, colocate=False, serves_policy=True, steps_per_rollout=1,
        train_group=None, model=ModelSource("hf"),
        actor=SimpleNamespace(loss=SimpleNamespace(uses_old_log_probs=True, tis_cap=2.0, mis=None)),
        rollout=SimpleNamespace(eval_sets=["heldout"], eval_subset=EvalSubset(),
                                rollout=SimpleNamespace(reward_key="score")),
        weight_sync=None, schedule=ScheduleConfig(mode), wandb=(False, "", None),
        health=HealthConfig(synchronous=mode == "off", **health),
    )  # fmt: skip
    folder = RunFolder(config.run_dir)
    manager, group = Actor(Manager(world)), Group(world)
    parts = RunParts(
        config, folder, MetricsSink(folder.path), group, HealthGuard(config.health), manager, Push(world),
        Colocation(False, group, manager), Evaluator(config, world), create_schedule(config.schedule, manager),
    )  # fmt: skip
    parts.restart_down_engines = lambda: []
    stopped = None
    try:
        run_steps(parts, Recovery(parts), 0)
    except RunStopped as err:
        stopped = str(err)
    parts.sink.close()
    return folder, folder.events(), stopped


def acted(events):
    return [(e["step"], e["action"], e["rule"]) for e in events if e["action"] != "warn"]


def test_an_engine_a_re_push_and_a_restart_leave_wrong_stops_the_run_on_its_newest_checkpoint(ray_session, tmp_path):
    """An engine off by 1.5 nats from the 6th step: pushed again after 4 steps of warnings, probed, restarted,
    probed again, and the run stops naming it on the checkpoint of step 5, not rolled back
    to the start as a policy fault would be."""
    world = World(off={ENGINES[1]: 1.5}, since=5)
    folder, events, stopped = run(tmp_path, world)
    assert acted(events) == [
        (8, "repush", "logprob_gap"),
        (8, "probe", "engine_mismatch"),
        (8, "restart_engine", "engine_mismatch"),
        (8, "stop", "engine_mismatch"),
    ]
    probe, restart, stop = [e for e in events if e["rule"] == "engine_mismatch"]
    assert probe["values"][ENGINES[0]] == pytest.approx(0.0, abs=1e-9)
    assert probe["values"][ENGINES[1]] == pytest.approx(1.5)
    assert restart["values"] == {ENGINES[1]: pytest.approx(1.5)} and world.restarted == [ENGINES[1]]
    assert stop["values"]["ended_on"] == 5 and set(stop["values"]) == {ENGINES[1], "ended_on"}
    assert stop["message"].startswith(f"step 8: engine(s) {ENGINES[1]} (mean gap 1.5 per token) disagree")
    assert "the newest" in stop["message"] and "check the engine the message names" in stopped
    final = json.loads((folder.path / "final.json").read_text())
    assert final["step"] == 5 and world.trained == 5  # the actor serves the checkpoint it ended on
    assert world.pushes.count("9") == 3  # the step's push, the re-push, the restarted engine's push
    assert "rollback" not in {e["action"] for e in events}


def test_an_engine_the_run_did_not_start_is_not_restarted_the_run_stops_naming_it(ray_session, tmp_path):
    world = World(off={ENGINES[0]: 1.5}, since=5, started=False)
    folder, events, stopped = run(tmp_path, world)
    assert acted(events) == [
        (8, "repush", "logprob_gap"),
        (8, "probe", "engine_mismatch"),
        (8, "stop", "engine_mismatch"),
    ]
    assert "and cannot be restarted: http://engine-a is not an engine this run started" in events[-1]["message"]
    assert events[-1]["values"]["ended_on"] == 5


def test_an_engine_a_restart_cures_is_restarted_and_the_run_goes_on(ray_session, tmp_path):
    world = World(off={ENGINES[1]: 1.5}, since=5, cured_by_restart=True)
    folder, events, stopped = run(tmp_path, world)
    assert stopped is None and world.restarted == [ENGINES[1]]
    assert acted(events) == [
        (8, "repush", "logprob_gap"),
        (8, "probe", "engine_mismatch"),
        (8, "restart_engine", "engine_mismatch"),
        (8, "probe", "engine_mismatch"),
    ]
    assert "after the restart every engine agrees" in events[-1]["message"]
    assert {e["step"] for e in events if e["action"] == "warn"} == {5, 6, 7, 8}  # its batches agree from then on
    assert json.loads((folder.path / "final.json").read_text())["step"] == 20


def test_a_gap_every_engine_answers_for_as_the_policys_is_never_rolled_back(ray_session, tmp_path):
    """The batches' log-probs differ from the trainer's by 0.15 but every engine agrees with it on the probe: the gap
    is not an engine's, so no rollback; the count begins afresh and another --health-patience steps re-push again."""
    world = World(policy_gap=0.15)
    folder, events, stopped = run(tmp_path, world, steps=10)
    assert stopped is None
    assert acted(events) == [
        (3, "repush", "logprob_gap"),
        (3, "probe", "engine_mismatch"),
        (7, "repush", "logprob_gap"),
        (7, "probe", "engine_mismatch"),
    ]
    probe = next(e for e in events if e["action"] == "probe")
    assert "the logprob_gap of the batches was the policy's" in probe["message"] and "no rollback" in probe["message"]
    assert all(gap == pytest.approx(0.0, abs=1e-9) for gap in probe["values"].values())


def test_asynchronous_batches_warn_of_nothing_and_a_stale_engine_is_still_caught_by_the_probe(ray_session, tmp_path):
    """One-step: every token is a version behind, its log-probs 0.2 off the trainer's because the policy moved (the
    lag-0 rules read none of them). From version 10 on the engines keep version 9's weights while acknowledging the
    pushes: the probe due every --health-patience steps (after step 11's push) finds both off, restarts them and
    finds them off again (the restart does not cure a lost update here), and the run stops on its newest checkpoint."""
    healthy = World(policy_gap=0.2)
    _, events, stopped = run(tmp_path / "healthy", healthy, steps=12, mode="one-step")
    assert stopped is None and events == []
    stale = World(policy_gap=0.2, stale_from=10)
    _, events, stopped = run(tmp_path / "stale", stale, steps=20, mode="one-step", max_logprob_gap=0.015)
    assert acted(events) == [
        (11, "probe", "engine_mismatch"),
        (11, "restart_engine", "engine_mismatch"),
        (11, "restart_engine", "engine_mismatch"),
        (11, "stop", "engine_mismatch"),
    ]
    probe = events[0]
    assert all(gap == pytest.approx(0.03) for gap in probe["values"].values())  # version 9 against 12, 0.01 each
    assert events[-1]["values"]["ended_on"] == 10
