"""How a run ends, through the real Recovery and RunFolder: on its last weights, on its best evaluated checkpoint after
a late fall is confirmed on the questions the evaluations left out (some sets graded whole, as --eval-sample 500 grades
Bamboogle's 125), or at a stop, whichever rule raised it; always with RUN/final.json naming the weights, also when the
confirmation fails or passes its deadline. A rollback or stop cut short by a crash is finished by the resume. The
rollout manager is a Ray actor grading with the real `evaluation_samples` over real eval files (its engines stand in
as a score per question); the actor's group loads a checkpoint by telling it which weights it serves."""

import json
import time
from types import SimpleNamespace

import pytest

from slime_search.evaluation.subsets import ROW_KEY, EvalSubset, UngradedQuestions
from slime_search.health.config import HealthConfig
from slime_search.health.events import Decision
from slime_search.health.guard import BEFORE, Event, HealthGuard, RunStopped
from slime_search.metrics import MetricsSink
from slime_search.ray.colocation import Colocation
from slime_search.ray.train_group import ModelSource
from slime_search.rollout.schedule import ScheduleConfig, Synchronous
from slime_search.run.evaluators import InStepEval
from slime_search.run.folder import RunFolder
from slime_search.run.parts import RunParts
from slime_search.run.recovery import STOPPED, Recovery
from tests.health.test_guard import step_record

pytestmark = pytest.mark.timeout(300)
FRESH_SCORE = {1000: 0.4, 900: 0.8}  # share of the left-out questions each version gets right (a subset of the other)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def write_set(folder, name: str, questions: int) -> str:
    path = folder / f"{name}.jsonl"
    rows = [{"prompt": f"{name} question {i}", "reward_model": {"ground_truth": "x"}, "data_source": name}
            for i in range(questions)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def right(row: int, score: float) -> bool:
    """Whether weights that get a share `score` of the questions right get row `row` right (a better version gets
    every question right a worse one does)."""
    return (row * 7919) % 1000 < 1000 * score


class GradingManager:
    """The RolloutManager's evaluate, as it runs it (evaluation_samples, evaluate_samples, question_grades), with the
    engines standing in as a fixed grade per question of the weights served. Set up afresh for each test (`setup`):
    the evaluate call numbered `hang_at` never answers (until the next setup), one numbered `fail_at` raises."""

    def __init__(self):
        self.generation = 0
        self.setup(())

    def setup(self, eval_sets, hang_at: int = 0, fail_at: int = 0) -> None:
        self.eval_sets, self.hang_at, self.fail_at = eval_sets, hang_at, fail_at
        self.served, self.graded, self.generation = 1000, [], self.generation + 1

    def serve(self, version: int) -> None:
        self.served = version

    def warm(self) -> None:
        """The imports of an evaluation, done before one is timed (a real manager has them by its first)."""
        import slime_search.rollout.eval_metrics
        import slime_search.rollout.manager  # noqa: F401

    def evaluate(self, examples=0, subset=None):
        from slime_search.rollout.data_source import DataConfig
        from slime_search.rollout.eval_metrics import GRADES, evaluate_samples, question_grades
        from slime_search.rollout.manager import evaluation_samples
        from slime_search.types import Sample

        self.graded.append({})
        call, graded, generation = len(self.graded), self.graded[-1], self.generation
        if call == self.fail_at:
            raise RuntimeError("the engine died mid-evaluation")
        while call == self.hang_at and generation == self.generation:
            time.sleep(0.2)
        if generation != self.generation:  # the test that waited on it is over
            return {}, []
        score = FRESH_SCORE[self.served]

        def run(source, config, params):
            items = source.take(len(source))
            graded[items[0].metadata["data_source"]] = len(items)
            return [[Sample(prompt=i.prompt, label=i.label, metadata=dict(i.metadata),
                            reward=float(right(i.metadata[ROW_KEY], score)))] for i in items], {}  # fmt: skip

        samples = evaluation_samples(self.eval_sets, DataConfig(path=""), "score", run, {}, subset)
        return {**evaluate_samples(samples), GRADES: question_grades(samples)}, []

    def evaluations(self) -> list[dict[str, int]]:
        return list(self.graded)

    def progress(self):
        return 0, 1

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        self.state = state

    def set_sampling_attempt(self, attempt: int) -> None:
        self.attempt = attempt


class Group:
    """The actor's group: loading a checkpoint makes the engines serve its weights (the transport's part)."""

    def __init__(self, ray, manager):
        self.ray, self.manager, self.loaded, self.lr_scales = ray, manager, [], []

    def load(self, root: str, steps_done: int) -> None:
        self.loaded.append(steps_done)
        if self.manager is not None:
            self.ray.get(self.manager.serve.remote(steps_done))

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scales.append(scale)


@pytest.fixture(scope="module")
def manager_actor(ray_session):
    actor = ray_session.remote(GradingManager).options(num_cpus=0, max_concurrency=4).remote()
    ray_session.get(actor.warm.remote())
    return actor


@pytest.fixture
def grading(ray_session, manager_actor):
    """The module's manager, set up for this test: grading(eval_sets, hang_at=..., fail_at=...)."""

    def setup(eval_sets, **faults):
        ray_session.get(manager_actor.setup.remote(eval_sets, **faults))
        return manager_actor

    yield setup
    ray_session.get(manager_actor.setup.remote(()))  # an evaluation left hanging ends


def handles(tmp_path, guard, manager=None, ray=None, eval_sets=(), eval_sample=500, eval_timeout=None):
    rollout = SimpleNamespace(eval_sets=eval_sets, eval_subset=EvalSubset(size=eval_sample))
    config = SimpleNamespace(
        health=guard.config, save_hf=False, eval_timeout=eval_timeout, rollout=rollout,
        schedule=ScheduleConfig(), model=ModelSource("hf"),
    )  # fmt: skip
    folder, group = RunFolder(tmp_path / "run"), Group(ray, manager)
    return RunParts(
        config, folder, MetricsSink(folder.path), group, guard, manager, None, Colocation(False, group),
        InStepEval(config, manager), Synchronous(config.schedule, manager),
    )  # fmt: skip


def carried_out(recovery: Recovery, events: list[Event]) -> None:
    """The stop among `events`, raised by the report to the loop and carried out there, as run.loop.run_steps does."""
    with pytest.raises(Decision) as decided:
        recovery.report(events)
    recovery.carry_out(decided.value.event)


def save(run, *steps) -> None:
    for k in steps:
        (run.checkpoints / f"iter_{k:07d}").mkdir(parents=True)
        (run.checkpoints / f"iter_{k:07d}" / "rollout_state.json").write_text(json.dumps({"steps_done": k}))
    (run.checkpoints / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))


def late_fall() -> HealthGuard:
    """Version 900 scored 0.600 and version 1000 0.539 on the 625 questions graded (500 of NQ, all 125 of Bamboogle):
    more than --health-end-drop below, with so many disagreements that the paired test cannot settle it."""
    guard = HealthGuard(HealthConfig())
    best = [1.0] * 375 + [0.0] * 250
    final = [0.0] * 210 + [1.0] * 165 + [1.0] * 172 + [0.0] * 78
    for version, grades in ((900, best), (1000, final)):
        guard.review_eval(version, {"eval/score": sum(grades) / len(grades)}, grades)
    assert guard.end_on_best([900, 1000]) is None and guard.end_candidate([900, 1000]) == (900, 0.6)
    return guard


def final_json(parts) -> dict:
    return json.loads((parts.folder.path / "final.json").read_text())


def test_a_late_fall_is_confirmed_on_the_left_out_questions_of_the_sets_that_have_any(ray_session, grading, tmp_path):
    """Bamboogle is graded whole: it has no left-out question and is passed over; NQ's 500 left out confirm the fall:
    the run ends on checkpoint 900, which the engines serve."""
    eval_sets = (("nq", write_set(tmp_path, "nq", 1000)), ("bamboogle", write_set(tmp_path, "bamboogle", 125)))
    manager = grading(eval_sets)
    parts = handles(tmp_path, late_fall(), manager, ray_session, eval_sets)
    save(parts.folder, 900, 1000)
    Recovery(parts).end(1000)
    assert ray_session.get(manager.evaluations.remote()) == [{"nq": 500}, {"nq": 500}]  # the final weights, then 900
    final = final_json(parts)
    assert final["step"] == 900 and final["checkpoint"] == "checkpoints/iter_0000900"
    fresh = UngradedQuestions(EvalSubset(size=500), 500).indices("nq", 1000)
    on_final, on_best = (sum(right(row, FRESH_SCORE[v]) for row in fresh) / 500 for v in (1000, 900))
    assert f"on 500 questions the evaluations did not grade {on_final:.3f} against {on_best:.3f}" in final["reason"]
    assert parts.group.loaded == [900] and [e["action"] for e in parts.folder.events()] == ["end_on_best"]


def test_with_every_question_graded_somewhere_nothing_is_left_to_confirm_on(ray_session, grading, tmp_path):
    """--eval-sample 500 grades all of Bamboogle's 125 and of a 300-question set: no confirmation is attempted, the
    run ends on its last weights."""
    eval_sets = (("nq", write_set(tmp_path, "nq", 300)), ("bamboogle", write_set(tmp_path, "bamboogle", 125)))
    manager = grading(eval_sets)
    guard = HealthGuard(HealthConfig())
    best, final = [1.0] * 255 + [0.0] * 170, [0.0] * 150 + [1.0] * 230 + [0.0] * 45
    for version, grades in ((900, best), (1000, final)):
        guard.review_eval(version, {"eval/score": sum(grades) / len(grades)}, grades)
    assert guard.end_on_best([900, 1000]) is None and guard.end_candidate([900, 1000]) is not None
    parts = handles(tmp_path, guard, manager, ray_session, eval_sets)
    save(parts.folder, 900, 1000)
    Recovery(parts).end(1000)
    assert ray_session.get(manager.evaluations.remote()) == [] and parts.group.loaded == []
    assert final_json(parts) == {"step": 1000, "checkpoint": "checkpoints/iter_0001000", "hf": None,
                             "reason": "the last step"}  # fmt: skip


@pytest.mark.parametrize(("fault", "cause"), [("hang_at", "TimeoutError: no result within 4 s for 50 questions"),
                                             ("fail_at", "the engine died mid-evaluation")])  # fmt: skip
def test_a_confirmation_that_fails_or_passes_its_deadline_ends_the_run_on_its_last_weights(
    ray_session, grading, tmp_path, fault, cause
):
    """The checkpoint's evaluation on the left-out questions never answers (--eval-timeout 4) or raises: the run
    ends on its last weights, served again, and RUN/final.json says why."""
    eval_sets = (("nq", write_set(tmp_path, "nq", 100)), ("bamboogle", write_set(tmp_path, "bamboogle", 25)))
    manager = grading(eval_sets, **{fault: 2})
    parts = handles(tmp_path, late_fall(), manager, ray_session, eval_sets, eval_sample=50, eval_timeout=4.0)
    save(parts.folder, 900, 1000)
    started = time.monotonic()
    Recovery(parts).end(1000)
    assert time.monotonic() - started < 60
    final = final_json(parts)
    assert final["step"] == 1000 and final["checkpoint"] == "checkpoints/iter_0001000"
    assert final["reason"].startswith("the last step: the late fall to the checkpoint of step 900 could not be "
                                      "confirmed") and cause in final["reason"]  # fmt: skip
    assert parts.group.loaded == [
        900,
        1000,
    ]  # the checkpoint was served for its evaluation, then the last weights again
    assert ray_session.get(manager.evaluations.remote())[0] == {"nq": 50}


def guard_after(steps: int) -> HealthGuard:
    guard = HealthGuard(HealthConfig())
    for step in range(steps):
        guard.review(step, step_record(step))
    return guard


def test_a_stop_on_unusable_rewards_ends_on_a_checkpoint_and_names_it_in_final_json(tmp_path):
    """A reward plugin's NaNs at step 45 stop the run (a stop raised through `report` to the loop, not a rollback
    budget): it ends on the checkpoint of step 40, served, with RUN/final.json and RUN/stopped.json; exit code 3 follows
    RunStopped."""
    guard = guard_after(45)
    parts = handles(tmp_path, guard)
    save(parts.folder, 0, 20, 40)
    events = guard.check_rollout(45, {"rollout/samples": 64.0, "rollout/reward_errors": 8.0},
                                 {"reward_error": "reward plugin m.f returned nan"})  # fmt: skip
    with pytest.raises(RunStopped, match="step 45: 8 of 64 rewards were not usable.*ends on the checkpoint of step 40"):
        carried_out(Recovery(parts, ["--x"]), events)
    final = final_json(parts)
    assert final["step"] == 40 and final["checkpoint"] == "checkpoints/iter_0000040"
    assert final["reason"] == "stopped by the health guard (reward_errors at step 45)"
    [stop] = parts.folder.events()
    assert stop["action"] == "stop" and stop["values"]["ended_on"] == 40.0 and parts.group.loaded == [40]
    assert json.loads((parts.folder.path / STOPPED).read_text())["event"] == stop


def test_damaged_weights_stop_on_the_last_confirmed_checkpoint_setting_the_newer_aside(tmp_path):
    """The actor's log-probs are not finite at step 41; checkpoint 40 is not yet confirmed (the steps after it were
    not seen): the run ends on checkpoint 20 and sets 40 aside, the stop recorded before anything moved."""
    guard = guard_after(41)
    parts = handles(tmp_path, guard)
    save(parts.folder, 0, 20, 40)
    with pytest.raises(RunStopped, match="weights are damaged"):
        carried_out(Recovery(parts), guard.check_batch(41, {"health/nonfinite_old_log_probs": 3.0}))
    assert (
        final_json(parts)["step"] == 20
        and parts.folder.latest_checkpoint() == 20
        and parts.folder.checkpoint_steps() == [0, 20]
    )
    assert [p.parent.name + "/" + p.name for p in parts.folder.undone_checkpoints()] == [
        "001-stop-at-step-41/iter_0000040"
    ]
    [stop] = parts.folder.events()
    assert "the checkpoints of steps [40] are kept in" in stop["message"] and parts.group.loaded == [20]


def test_a_stop_before_any_checkpoint_names_the_unsaved_weights(tmp_path):
    parts = handles(tmp_path, guard_after(0))
    with pytest.raises(RunStopped, match="rewards were not usable"):
        carried_out(
            Recovery(parts), parts.guard.check_rollout(0, {"rollout/samples": 8.0, "rollout/reward_errors": 2.0}, {})
        )
    final = final_json(parts)
    assert final["step"] == 0 and final["checkpoint"] is None and final["reason"].endswith("no checkpoint holds them")
    assert not parts.folder.checkpoints.exists() and parts.group.loaded == []


@pytest.mark.parametrize("crash_in", ["record_events", "rewind_to"])
def test_a_rollback_cut_short_by_a_crash_is_finished_by_the_resume(
    ray_session, grading, tmp_path, monkeypatch, crash_in
):
    """The rollback at step 64 back to checkpoint 40 crashes after it was written down: before its event is recorded,
    or between the record and the move. Started again, the run finishes it: the event recorded once, the tracker on
    40, checkpoint 60 set aside, the guard's rollback count and remedy as after a rollback that went through."""
    import slime_search.run.folder as run_folder

    manager = grading(())
    parts = handles(tmp_path, guard_after(65), manager, ray_session)
    save(parts.folder, 0, 20, 40, 60)
    rollback = Event(64, "rollback", "reward_drop", "reward fell", {BEFORE: 45.0})
    real = getattr(RunFolder if crash_in == "record_events" else run_folder, crash_in)
    with monkeypatch.context() as patch:

        def crash(*args, **kwargs):
            raise OSError("the node went down")

        if crash_in == "record_events":
            patch.setattr(RunFolder, "record_events", crash)
        else:
            patch.setattr(run_folder, "rewind_to", crash)
        with pytest.raises(OSError, match="node went down"):
            Recovery(parts).roll_back(rollback)
    assert getattr(RunFolder if crash_in == "record_events" else run_folder, crash_in) is real
    assert parts.folder.latest_checkpoint() == 60  # nothing moved yet
    again = handles(tmp_path, HealthGuard(HealthConfig()), manager, ray_session)
    assert Recovery(again).resume() == 40
    done = [e for e in again.folder.events() if e["action"] == "rollback"]
    assert len(done) == 1 and done[0]["values"]["to_step"] == 40.0 and done[0]["attempt"] == 1
    assert again.folder.checkpoint_steps() == [0, 20, 40] and again.folder.latest_checkpoint() == 40
    assert [p.parent.name + "/" + p.name for p in again.folder.undone_checkpoints()] == [
        "001-rollback-at-step-64/iter_0000060"
    ]
    assert again.guard.rollbacks == 1 and again.group.lr_scales == [0.5] and again.group.loaded == [40]
    assert not (again.folder.undone / "pending.json").exists()
    assert again.folder.plan_set_aside(20, "later").name == "002-later"  # numbers go on from the last one taken


def test_an_evaluation_inside_the_step_that_never_answers_ends_the_wait_naming_the_flag(ray_session, grading, tmp_path):
    eval_sets = (("nq", write_set(tmp_path, "nq", 40)),)
    manager = grading(eval_sets, hang_at=1)
    parts = handles(tmp_path, guard_after(0), manager, ray_session, eval_sets, eval_timeout=2.0)
    parts.config.eval_due = lambda step: True
    parts.config.log_rollout_examples = 0
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"version 25 \(40 questions\) had no result within 2 s \(--eval-timeout\)"):
        InStepEval(parts.config, manager).results(25)
    assert 2.0 <= time.monotonic() - started < 30
