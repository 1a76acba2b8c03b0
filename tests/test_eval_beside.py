"""Evaluation beside training (slime_search.run.eval_engine): which versions are evaluated when the evaluator is slower
than the interval, what a rollback drops, and a late result's review by the health guard. The evaluator is a Ray
actor that holds each evaluation until the test releases it; the actor group only writes the weights folder (the
end-to-end run with the real actor and eval engine is tests/e2e/test_eval_beside.py)."""

import json
import time
from pathlib import Path

import pytest

from slime_search.run.eval_engine import EvalEngine


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


class HeldEvaluator:
    """Evaluates a version only once `release(version)` was called; its EM is the one the test set for it. It reads
    the folder it is given: the weights of that version must have been written. A version without an EM fails."""

    def __init__(self, em_by_version: dict[int, float], released: tuple[int, ...] = ()):
        self.em_by_version = em_by_version
        self.released: set[int] = set(released)
        self.started: list[int] = []

    def release(self, version: int) -> None:
        self.released.add(version)

    def started_versions(self) -> list[int]:
        return list(self.started)

    def evaluate_weights(self, folder: str, version: int, examples: int) -> dict:
        written = json.loads((Path(folder) / "weights.json").read_text())
        assert written["version"] == version, (written, version)
        self.started.append(version)
        while version not in self.released:
            time.sleep(0.01)
        metrics = {"eval/score": self.em_by_version[version], "eval/em": self.em_by_version[version]}
        return {"version": version, "metrics": metrics, "shown": [], "load_s": 0.01, "eval_s": 0.02}


class WritingGroup:
    """The actor group's part: write the weights of the version the driver is at into the folder it names."""

    def __init__(self):
        self.version = 0

    def on_all_ranks(self, method: str, original_hf: str, out: str, bucket_bytes: int) -> list:
        assert method == "write_hf_streamed"
        Path(out).mkdir(parents=True)
        (Path(out) / "weights.json").write_text(json.dumps({"version": self.version}))
        return [out]


class Sync:
    hf_checkpoint = "unused"
    bucket_bytes = 1 << 20


class BrokenEvaluator:
    """An eval engine that runs out of memory on every evaluation."""

    def evaluate_weights(self, folder: str, version: int, examples: int) -> dict:
        raise MemoryError(f"CUDA out of memory while evaluating version {version}")


def held(ray, em_by_version, released=()):
    return ray.remote(HeldEvaluator).options(max_concurrency=4).remote(em_by_version, released)


def beside_with(ray, tmp_path, em_by_version, **options):
    evaluator = held(ray, em_by_version)
    group = WritingGroup()
    return EvalEngine(evaluator, group, tmp_path, Sync(), examples=0, **options), evaluator, group


class Restarts:
    """The restart factory: hands out the given evaluators in turn (an exception instead of one is raised), and
    remembers them."""

    def __init__(self, *evaluators):
        self.left = list(evaluators)
        self.made: list = []

    def __call__(self):
        evaluator = self.left.pop(0)
        if isinstance(evaluator, Exception):
            raise evaluator
        self.made.append(evaluator)
        return evaluator


def dead(ray, actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def submit(beside, group, version):
    group.version = version
    return beside.submit(version)


def wait_started(ray, evaluator, version):
    deadline = time.monotonic() + 30
    while version not in ray.get(evaluator.started_versions.remote()):
        assert time.monotonic() < deadline, f"version {version} never started"
        time.sleep(0.01)


def test_a_slow_evaluator_stays_one_version_behind_and_skips_what_it_cannot_reach(ray_session, tmp_path):
    ray = ray_session
    beside, evaluator, group = beside_with(ray, tmp_path, {0: 0.1, 2: 0.2, 4: 0.3, 6: 0.4})
    assert submit(beside, group, 0) > 0
    wait_started(ray, evaluator, 0)
    submit(beside, group, 2)  # waits behind 0
    submit(beside, group, 4)  # 2 has not started: it is skipped, 4 waits
    assert sorted(p.name for p in (tmp_path / "eval_weights").iterdir()) == ["step_0.1", "step_4.3"]
    assert beside.collect() == []  # nothing finished yet: the step does not wait
    ray.get(evaluator.release.remote(0))
    ray.get(evaluator.release.remote(4))
    first = beside.collect(wait=True)
    assert [r.version for r in first] == [0, 4]
    assert [r.metrics["eval/em"] for r in first] == [0.1, 0.3]
    assert first[0].record["eval/skipped_versions"] == 0 and first[1].record["eval/skipped_versions"] == 1
    assert first[1].record["eval/wait_s"] > 0 and first[1].record["time/eval_s"] == 0.02
    assert ray.get(evaluator.started_versions.remote()) == [0, 4]
    assert not beside.busy() and not list((tmp_path / "eval_weights").iterdir())


def test_a_rollback_drops_the_evaluations_of_versions_it_undid(ray_session, tmp_path):
    """Back to step 2: versions 4 and 6 no longer exist, and version 2 is evaluated again by the new timeline (its
    records were dropped), so the pending evaluation of version 2 from before is dropped too: one record per version."""
    ray = ray_session
    beside, evaluator, group = beside_with(ray, tmp_path, {2: 0.5, 4: 0.6, 6: 0.7})
    submit(beside, group, 2)
    wait_started(ray, evaluator, 2)
    submit(beside, group, 4)
    beside.rolled_back(2)
    assert [p.name for p in (tmp_path / "eval_weights").iterdir()] == ["step_2.1"]  # read by the running one
    submit(beside, group, 2)  # version 2 of the new timeline queues behind the undone one
    ray.get(evaluator.release.remote(2))
    results = beside.collect(wait=True)
    assert [r.version for r in results] == [2] and ray.get(evaluator.started_versions.remote()) == [2, 2]
    submit(beside, group, 4)
    submit(beside, group, 6)
    beside.rolled_back(5)  # 4 is running and stays; 6 waits and goes
    ray.get(evaluator.release.remote(4))
    assert [r.version for r in beside.collect(wait=True)] == [4] and not beside.busy()


def test_a_failed_evaluation_is_dropped_and_a_fresh_evaluator_takes_the_next(
    ray_session, tmp_path, caplog, monkeypatch
):
    """The eval engine runs out of memory on version 0: the training loop sees no exception, a warning names the
    version and the cause, the failure is counted, the broken evaluator is killed, and version 2 (waiting behind it)
    is evaluated by a fresh one, started at the second try (the first found no GPU free yet)."""
    ray = ray_session
    monkeypatch.setattr("slime_search.run.eval_engine.RESTART_RETRY_S", 0.01)
    broken = ray.remote(BrokenEvaluator).remote()
    fresh = held(ray, {2: 0.4}, released=(2,))
    restarts = Restarts(RuntimeError("--eval-engine needs 1 GPU(s)"), fresh)
    group = WritingGroup()
    beside = EvalEngine(broken, group, tmp_path, Sync(), 0, timeout_s=60, restart=restarts)
    submit(beside, group, 0)
    submit(beside, group, 2)  # waits behind the running version 0
    with caplog.at_level("WARNING", logger="slime_search.run.eval_engine"):
        results = beside.collect(wait=True)
    assert [r.version for r in results] == [2] and results[0].metrics["eval/em"] == 0.4
    dropped = [r.getMessage() for r in caplog.records if "version 0 dropped" in r.getMessage()]
    assert len(dropped) == 1 and "CUDA out of memory" in dropped[0]
    assert any("restart failed" in r.getMessage() and "needs 1 GPU" in r.getMessage() for r in caplog.records)
    assert ray.get(fresh.started_versions.remote()) == [2] and restarts.made == [fresh]
    assert beside.evaluator is fresh and dead(ray, broken)
    assert beside.metrics() == {
        "eval/running_age_s": 0.0,
        "eval/failures": 1.0,
        "eval/restarts": 1.0,
        "eval/stopped": 0.0,
    }
    assert not beside.busy() and not list((tmp_path / "eval_weights").iterdir())


def test_without_a_restart_factory_the_same_evaluator_goes_on(ray_session, tmp_path):
    ray = ray_session
    beside, evaluator, group = beside_with(ray, tmp_path, {2: 0.4}, timeout_s=60)  # no EM for 0: it fails
    ray.get([evaluator.release.remote(0), evaluator.release.remote(2)])
    submit(beside, group, 0)
    assert beside.collect(wait=True) == [] and beside.metrics()["eval/failures"] == 1
    submit(beside, group, 2)
    assert [r.version for r in beside.collect(wait=True)] == [2]
    assert ray.get(evaluator.started_versions.remote()) == [0, 2] and beside.metrics()["eval/restarts"] == 0


DEADLINE_S = 3.0  # short, and long enough for the steps before the first look on a loaded machine


def test_a_hung_evaluation_is_dropped_at_its_deadline_and_the_final_wait_is_bounded(ray_session, tmp_path):
    """Version 0 never finishes: the step records show its age growing; at the deadline it is dropped, the
    hung evaluator is killed and a fresh one evaluates the waiting version; the final wait ends with the deadline."""
    ray = ray_session
    fresh, spare = held(ray, {2: 0.4}, released=(2,)), held(ray, {})
    restarts = Restarts(fresh, spare)
    beside, hung, group = beside_with(ray, tmp_path, {0: 0.1}, timeout_s=DEADLINE_S, restart=restarts)
    ray.get([actor.__ray_ready__.remote() for actor in (fresh, spare, hung)])  # the deadline is not for their start
    submit(beside, group, 0)
    wait_started(ray, hung, 0)
    first = beside.metrics()["eval/running_age_s"]
    time.sleep(0.2)
    assert beside.metrics()["eval/running_age_s"] >= first + 0.2 > 0.2
    assert beside.collect() == [] and beside.busy()  # within its deadline: the step does not wait
    submit(beside, group, 2)
    started = time.monotonic()
    results = beside.collect(wait=True)
    assert time.monotonic() - started < DEADLINE_S + 10  # the deadline, a kill and a fresh evaluator's one evaluation
    assert [r.version for r in results] == [2] and restarts.made == [fresh] and dead(ray, hung)
    assert ray.get(fresh.started_versions.remote()) == [2]
    metrics = beside.metrics()
    assert (metrics["eval/failures"], metrics["eval/restarts"], metrics["eval/running_age_s"]) == (1, 1, 0)

    submit(beside, group, 4)  # the fresh evaluator hangs on version 4 (never released): the run's last version
    started = time.monotonic()
    assert beside.collect(wait=True) == []
    assert DEADLINE_S - 0.1 < time.monotonic() - started < DEADLINE_S + 10 and not beside.busy()
    assert beside.metrics()["eval/failures"] == 2 and restarts.made == [fresh, spare] and dead(ray, fresh)


def test_evaluation_beside_training_stops_after_failures_in_a_row(ray_session, tmp_path, caplog):
    """Version 0 fails, the fresh evaluator fails version 2, and the restart after it fails: three failures in a row
    stop evaluation beside training; the run goes on without it (nothing written, nothing waited for)."""
    ray = ray_session
    first, second = ray.remote(BrokenEvaluator).remote(), ray.remote(BrokenEvaluator).remote()
    restarts = Restarts(second, RuntimeError("--eval-engine needs 1 GPU(s)"))
    group = WritingGroup()
    beside = EvalEngine(first, group, tmp_path, Sync(), 0, timeout_s=60, restart=restarts)
    submit(beside, group, 0)
    assert beside.collect(wait=True) == [] and beside.metrics()["eval/stopped"] == 0
    submit(beside, group, 2)
    with caplog.at_level("WARNING", logger="slime_search.run.eval_engine"):
        assert beside.collect(wait=True) == []
    assert any("needs 1 GPU" in r.getMessage() for r in caplog.records)
    assert any("evaluation beside training stops" in r.getMessage() for r in caplog.records)
    assert beside.metrics() == {
        "eval/running_age_s": 0.0,
        "eval/failures": 2.0,
        "eval/restarts": 1.0,
        "eval/stopped": 1.0,
    }
    assert dead(ray, first) and dead(ray, second) and beside.evaluator is None
    assert submit(beside, group, 4) == 0.0 and not beside.busy()
    assert beside.collect(wait=True) == [] and not list((tmp_path / "eval_weights").iterdir())


def test_a_late_held_out_drop_rolls_back_to_before_it(tmp_path):
    """The guard reviews a result when it arrives: drops at versions 6 and 8, found while the run is at steps 9 and 11,
    call for a rollback to before version 6 (the first only warns); the records are kept under their versions."""
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.run.eval_engine import EvalResult
    from slime_search.run.folder import RunFolder
    from slime_search.run.recovery import Recovery
    from tests.run_parts_helpers import run_parts

    # patience 2: the second fall, found late, is the one that rolls back
    sink, run, guard = (
        MetricsSink(tmp_path),
        RunFolder(tmp_path),
        HealthGuard(HealthConfig(eval_drop=0.2, eval_patience=2)),
    )
    recovery = Recovery(run_parts(folder=run, sink=sink, guard=guard))
    for version, em, step in ((2, 0.6, 3), (4, 0.62, 5), (6, 0.3, 9), (8, 0.32, 11)):
        result = EvalResult(version, {"eval/score": em, "eval/em": em}, [], {"time/eval_s": 1.0})
        rollback = recovery.record_eval(result, step)
        assert (rollback is None) == (version < 8)
    assert rollback.rule == "eval_drop" and rollback.step == 8 and rollback.values["roll_back_before"] == 4.0
    records = sink.read()
    assert [(r["step"], r["eval/lag_steps"]) for r in records] == [(2, 1), (4, 1), (6, 3), (8, 3)]
    events = [json.loads(line) for line in run.health.read_text().splitlines()]
    assert [(e["action"], e["rule"]) for e in events] == [("watch", "eval_drop"), ("rollback", "eval_drop")]


# The 3B recipe's schedule (examples/search-r1/run_qwen2.5_3B.sh): 1,000 steps, saves every 20, evaluations every 25
RECIPE_FLAGS = ["--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "1000",
                "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--save-interval", "20",
                "--eval-interval", "25", "--keep-checkpoints", "2", "--eval-prompt-data", "nq", "e.parquet"]  # fmt: skip


def recipe_config(*extra):
    from slime_search.arguments import parse_args
    from slime_search.run.config import run_config

    return run_config(parse_args([*RECIPE_FLAGS, *extra]), vocab_size=100, use_gpu=False)


def test_with_the_guard_on_every_evaluated_version_of_the_recipe_is_saved():
    """Saves fall at 20, 25, 40, 50, 60, 75, 80, 100 of the recipe's first 100 steps: every save step and every
    evaluated version (the guard can go back to, stop on or end on a version only when it has a checkpoint)."""
    config = recipe_config()
    assert [k for k in range(1, 101) if config.save_due(k)] == [20, 25, 40, 50, 60, 75, 80, 100]
    assert sum(config.save_due(k) for k in range(1, 1001)) == 50 + 40 - 10 and config.save_due(1000)
    unguarded = recipe_config("--no-health-guard")
    assert [k for k in range(1, 101) if unguarded.save_due(k)] == [20, 40, 60, 80, 100]


class SavingGroup(WritingGroup):
    """The actor group's saves as well: a checkpoint folder with the rollout state, the tracker written last."""

    def save(self, root: str, steps_done: int, extra_files: dict[str, str]) -> None:
        folder = Path(root) / f"iter_{steps_done:07d}"
        folder.mkdir(parents=True)
        for name, text in extra_files.items():
            (folder / name).write_text(text)
        (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(steps_done))


class PromptData:
    """The rollout manager's part of a checkpoint: its data position."""

    def state_dict(self) -> dict:
        return {"epoch": 0, "offset": 0}


class NoHandOver:
    def for_weight_push(self) -> None: ...

    def for_generation(self) -> None: ...


def test_with_evaluations_slower_than_a_save_interval_every_graded_version_still_has_its_checkpoint(
    ray_session, tmp_path
):
    """The recipe's schedule and --keep-checkpoints 2, with evaluations beside training that take 30 or 60 steps
    each (the seven test sets on one engine take longer than a save interval): the version being evaluated and the
    one waiting keep their checkpoints, so every version whose grade arrives can still be gone back to, stopped on or
    ended on. The real guard, evaluator bookkeeping, saves and pruning; the loop is the driver's (run.loop)."""
    from slime_search.backends.megatron.checkpoint import iteration_dir
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.run.evaluators import BesideEval
    from slime_search.run.folder import RunFolder
    from slime_search.run.recovery import Recovery
    from tests.health.test_guard import step_record
    from tests.run_parts_helpers import run_parts

    ray = ray_session
    config = recipe_config()
    score = {v: min(0.45, 0.1 + v / 600) for v in range(0, 1001, 25)}  # rises, then a plateau
    evaluator, group = held(ray, score), SavingGroup()
    run = RunFolder(tmp_path / "run")
    colocation = NoHandOver()
    parts = run_parts(
        config=config, folder=run, sink=MetricsSink(run.path), group=group, guard=HealthGuard(config.health),
        manager=ray.remote(PromptData).remote(), colocation=colocation,
        evaluator=BesideEval(config, colocation, EvalEngine(evaluator, group, run.path, Sync(), examples=0, timeout_s=600)),
    )  # fmt: skip
    recovery = Recovery(parts)
    started, graded, lost = {}, [], []
    parts.save(0)
    for step in range(301):
        group.version = step
        for result in parts.evaluator.results(step):
            graded.append(result.version)
            if not iteration_dir(run.checkpoints, result.version).is_dir():
                lost.append(result.version)
            assert recovery.record_eval(result, step) is None
        parts.guard.review(step, step_record(step))
        if config.save_due(step + 1):
            parts.save(step + 1)
        for version in ray.get(evaluator.started_versions.remote()):
            started.setdefault(version, step)
        for version, at in started.items():  # the evaluations take 30 and 60 steps in turn
            if step - at == (30 if len(graded) % 2 else 60):
                ray.get(evaluator.release.remote(version))
    assert len(graded) >= 5 and lost == []
    assert parts.guard.policy.best_evaluated(run.checkpoint_steps()) is not None
    assert len(run.checkpoint_steps()) <= 2 + 4  # pruning still prunes: 2 kept, the guard's and the evaluations'
