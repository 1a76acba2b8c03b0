"""Evaluation beside training (slime_search.eval_beside): which versions are evaluated when the evaluator is slower
than the interval, what a rollback drops, and a late result's review by the health guard. The evaluator is a Ray
actor that holds each evaluation until the test releases it; the actor group only writes the weights folder (the
end-to-end run with the real actor and eval engine is tests/e2e/test_eval_beside.py)."""

import json
import time
from pathlib import Path

import pytest

from slime_search.eval_beside import EvalBeside


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


class HeldEvaluator:
    """Evaluates a version only once `release(version)` was called; its EM is the one the test set for it. It reads
    the folder it is given: the weights of that version must have been written."""

    def __init__(self, em_by_version: dict[int, float]):
        self.em_by_version = em_by_version
        self.released: set[int] = set()
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


def beside_with(ray, tmp_path, em_by_version):
    evaluator = ray.remote(HeldEvaluator).options(max_concurrency=4).remote(em_by_version)
    group = WritingGroup()
    return EvalBeside(evaluator, group, tmp_path, Sync(), examples=0), evaluator, group


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


def test_a_late_held_out_drop_rolls_back_to_before_it(tmp_path):
    """The guard reviews a result when it arrives: a drop at version 6, found while the run is at step 9, calls for a
    rollback to before version 6; the record is kept under version 6."""
    from slime_search.eval_beside import EvalResult
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.run_folder import RunFolder
    from slime_search.train import record_eval_beside

    sink, run, guard = MetricsSink(tmp_path), RunFolder(tmp_path), HealthGuard(HealthConfig(eval_drop=0.2))
    for version, em, step in ((2, 0.6, 3), (4, 0.62, 5), (6, 0.3, 9)):
        result = EvalResult(version, {"eval/score": em, "eval/em": em}, [], {"time/eval_s": 1.0})
        rollback = record_eval_beside(result, sink, run, guard, step)
        assert (rollback is None) == (version < 6)
    assert rollback.rule == "eval_drop" and rollback.step == 6 and rollback.values["since"] == 4.0
    records = sink.read()
    assert [(r["step"], r["eval/lag_steps"]) for r in records] == [(2, 1), (4, 1), (6, 3)]
    assert [json.loads(line)["rule"] for line in run.health.read_text().splitlines()] == ["eval_drop"]
