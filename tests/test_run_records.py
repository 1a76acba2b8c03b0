"""Run records stay exact across crashes: whole-line appends, a torn tail dropped, a fresh start truncating."""

import json
from types import SimpleNamespace

import pytest

from slime_search.config.lora import LoraConfig
from slime_search.health.config import HealthConfig
from slime_search.health.guard import HealthGuard
from slime_search.metrics import MetricsSink
from slime_search.ray.train_group import ModelSource
from slime_search.run.folder import RunFolder
from slime_search.run.recovery import Recovery
from slime_search.utils.records import RecordsError, append_records, keep_records_before, read_records
from tests.health.test_guard import step_record
from tests.run_parts_helpers import run_parts


def test_appends_are_whole_lines_and_a_torn_tail_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_records(path, [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}])
    with open(path, "a") as handle:
        handle.write('{"step": 2, "x": 3')  # a kill in the middle of the next write
    assert read_records(path) == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    assert keep_records_before(path, 2) == 0 and path.read_text().endswith('"x": 2.0}\n')  # the tail is gone
    append_records(path, [{"step": 2, "x": 3.0}])
    assert [r["step"] for r in read_records(path)] == [0, 1, 2]


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(RecordsError, match="rollouts.jsonl:2"):
        read_records(path)


def test_a_run_killed_before_its_first_checkpoint_is_recorded_once_per_step_when_rerun(tmp_path):
    """With no checkpoint the rerun starts at step 0: what the killed attempt recorded is dropped, so every step
    appears once (the earlier attempt's torn line with it)."""
    run, sink = RunFolder(tmp_path), MetricsSink(tmp_path)
    for step in (0, 1):
        sink.log(step, {"train/loss": 1.0})
        run.record_examples(step, "train", [{"prompt": "p", "segments": []}])
    with open(sink.path, "a") as handle:
        handle.write('{"step": 2, "train/lo')
    run.record_events([{"step": 1, "action": "warn", "rule": "logprob_gap", "message": "", "attempt": 0}])
    # nothing to push: the engines serve the HF weights
    config = SimpleNamespace(model=ModelSource("hf"), health=HealthConfig())
    assert Recovery(run_parts(config=config, folder=run, sink=sink, guard=HealthGuard(HealthConfig()))).resume() == 0
    assert sink.read() == [] and read_records(run.examples) == [] and run.events() == []
    for step in range(3):
        sink.log(step, {"train/loss": 0.5})
        run.record_examples(step, "train", [{"prompt": "p", "segments": []}])
    assert [r["step"] for r in sink.read()] == [0, 1, 2]
    assert [json.loads(line)["step"] for line in run.examples.read_text().splitlines()] == [0, 1, 2]


class RecordedPushes:
    """The transport and colocation a fresh start reaches: the versions pushed, and the hand-overs before them."""

    def __init__(self):
        self.calls = []

    def push(self, version: str) -> str:
        self.calls.append(("push", version))
        return version

    def for_weight_push(self) -> None:
        self.calls.append(("for_weight_push",))


@pytest.mark.parametrize(
    ("source", "pushed"),
    [
        (ModelSource("hf"), []),
        (ModelSource("hf", load="torch_dist"), [("for_weight_push",), ("push", "0")]),
        (
            ModelSource("hf", lora=LoraConfig(lora_rank=4, lora_adapter_path="adapter")),
            [("for_weight_push",), ("push", "0")],
        ),
        (ModelSource("hf", lora=LoraConfig(lora_rank=4)), []),
        (
            ModelSource("hf", lora=LoraConfig(lora_rank=4, lora_sync_from_tensor=True)),
            [("for_weight_push",), ("push", "0")],
        ),
    ],
)
def test_a_fresh_start_pushes_version_0_when_the_engines_would_serve_another_policy(tmp_path, source, pushed):
    """The engines start on the HF folder's weights. An actor that starts elsewhere (--load, or adapters from
    --lora-adapter-path) must be pushed to them as version 0, else the first rollout samples another policy; so must
    adapters the engines serve by name (--lora-sync-from-tensor), else the first rollout names an adapter no engine
    holds."""
    both = RecordedPushes()
    parts = run_parts(
        config=SimpleNamespace(model=source, health=HealthConfig()), folder=RunFolder(tmp_path),
        sink=MetricsSink(tmp_path), guard=HealthGuard(HealthConfig()), transport=both, colocation=both,
    )  # fmt: skip
    assert Recovery(parts).resume() == 0
    assert both.calls == pushed


def test_a_resume_forgets_the_warnings_it_will_redo_and_keeps_the_rollbacks(tmp_path):
    run = RunFolder(tmp_path)
    events = [
        {"step": 3, "action": "warn", "attempt": 0},
        {"step": 6, "action": "warn", "attempt": 0},  # the timeline a rollback abandoned: history, kept
        {"step": 6, "action": "rollback", "attempt": 0},  # the decision
        {"step": 6, "action": "rollback", "attempt": 0, "values": {"to_step": 4}},  # done
        {"step": 5, "action": "warn", "attempt": 1},  # after the checkpoint of step 4, in the current attempt: redone
        {"step": 5, "action": "stop", "attempt": 1},
    ]
    run.record_events(events)
    assert run.drop_events_from(4, attempt=1) == 1
    assert run.events() == [e for e in events if e["attempt"] == 0 or e["action"] == "stop"]
    assert run.rollback_steps() == [6]
    assert run.rollback_targets() == [4]  # a resumed guard passes over a target the trouble came back from


def test_a_rollback_rewinds_the_tracker_and_sets_the_checkpoints_it_undid_aside(tmp_path):
    from slime_search.backends.megatron.checkpoint import latest_iteration, prune_iterations, rewind_to

    make_checkpoints(tmp_path / "a", [2, 4, 6, 8], tracked=8)
    assert rewind_to(tmp_path / "a", 4, tmp_path / "a" / "undone" / "001-x") == [6, 8]
    assert latest_iteration(tmp_path / "a") == 4 and sorted(p.name for p in (tmp_path / "a").glob("iter_*")) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000009.partial",
    ]
    assert sorted(p.name for p in (tmp_path / "a" / "undone" / "001-x").iterdir()) == ["iter_0000006", "iter_0000008"]
    with pytest.raises(FileNotFoundError, match="iteration 5"):
        rewind_to(tmp_path / "a", 5, tmp_path / "elsewhere")
    # the guard's rollback target is never pruned
    make_checkpoints(tmp_path / "b", [1, 2, 3, 4, 5], tracked=5)
    assert prune_iterations(tmp_path / "b", keep=2, protect=(2,)) == [1, 3]


def test_nothing_a_rollback_or_a_stop_undoes_is_deleted_and_only_keep_checkpoints_prunes_it(tmp_path):
    """Checkpoints and HF copies set aside by two rollbacks are all kept; --keep-checkpoints 2 keeps the newest two of
    those set aside (and their HF copies) besides the newest two of the run; final.json names the weights."""
    run = RunFolder(tmp_path)
    for step in (2, 4, 6, 8):
        (run.checkpoints / f"iter_{step:07d}").mkdir(parents=True)
        run.hf_folder(step).mkdir(parents=True)
    (run.checkpoints / "latest_checkpointed_iteration.txt").write_text("8")
    moved, aside = run.set_aside(4, "rollback-at-step-9")
    assert moved == [6, 8] and aside.name == "001-rollback-at-step-9" and run.checkpoint_steps() == [2, 4]
    assert sorted(p.name for p in (run.path / "hf" / "undone" / aside.name).iterdir()) == ["step_6", "step_8"]
    moved, aside = run.set_aside(2, "stop-at-step-5")
    assert moved == [4] and aside.name == "002-stop-at-step-5"
    assert [p.name for p in run.undone_checkpoints()] == ["iter_0000006", "iter_0000008", "iter_0000004"]
    assert run.prune_checkpoints(keep=2) == []  # one checkpoint in the timeline: nothing of it goes
    assert [p.parent.name + "/" + p.name for p in run.undone_checkpoints()] == [
        "001-rollback-at-step-9/iter_0000008",
        "002-stop-at-step-5/iter_0000004",
    ]
    assert not (run.path / "hf" / "undone" / "001-rollback-at-step-9" / "step_6").exists()
    assert (run.path / "hf" / "undone" / "001-rollback-at-step-9" / "step_8").is_dir()
    final = run.record_final(2, "stopped by the health guard", hf=True)
    assert json.loads((run.path / "final.json").read_text()) == final
    assert final["checkpoint"] == "checkpoints/iter_0000002" and final["hf"] == "hf/step_2"


def make_checkpoints(root, iterations, tracked):
    for iteration in iterations:
        (root / f"iter_{iteration:07d}").mkdir(parents=True)
    (root / "iter_0000009.partial").mkdir()  # a save in flight is not a checkpoint
    (root / "latest_checkpointed_iteration.txt").write_text(str(tracked))


def test_only_the_newest_checkpoints_are_kept_and_never_the_tracked_one(tmp_path):
    from slime_search.backends.megatron.checkpoint import prune_iterations

    make_checkpoints(tmp_path / "a", [1, 2, 3, 4, 5], tracked=5)
    assert prune_iterations(tmp_path / "a", keep=2) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "a").glob("iter_*")) == [
        "iter_0000004", "iter_0000005", "iter_0000009.partial"
    ]  # fmt: skip
    make_checkpoints(tmp_path / "b", [1, 2, 3], tracked=1)  # a run resumed from an older checkpoint
    assert prune_iterations(tmp_path / "b", keep=1) == [2]
    make_checkpoints(tmp_path / "c", [1, 2, 3], tracked=3)
    assert prune_iterations(tmp_path / "c", keep=0) == []


def test_a_watched_held_out_fall_names_the_checkpoint_a_rollback_would_use(tmp_path):
    """The last version within the margin (4) is not always where a rollback goes: a skipped step 3 leaves
    checkpoint 4 unconfirmed, so the rollback policy would go to checkpoint 2, and the watch says so."""
    run, sink = RunFolder(tmp_path), MetricsSink(tmp_path)
    make_checkpoints(run.checkpoints, [0, 2, 4, 6], tracked=6)
    guard = HealthGuard(HealthConfig())
    for step in range(7):  # step 3's batch was skipped: the steps around checkpoint 4 did not all stay clean
        guard.review(step, step_record(step, **({"health/step_skipped": 1.0} if step == 3 else {})))
    config = SimpleNamespace(model=ModelSource("hf"), health=HealthConfig())
    recovery = Recovery(run_parts(config=config, folder=run, sink=sink, guard=guard))

    def evaluate(version, grades):
        metrics = {"eval/score": sum(grades) / len(grades), "grades": grades}
        result = SimpleNamespace(version=version, metrics=metrics, record={}, shown=[])
        return recovery.record_eval(result, version)

    right, wrong = [1.0] * 64, [0.0] * 64
    assert evaluate(2, right) is None and evaluate(4, right) is None
    assert evaluate(6, wrong) is None  # a first fall is watched, not rolled back
    (watch,) = [e for e in run.events() if e["action"] == "watch"]
    assert "version 4 was the last within it" in watch["message"]
    assert watch["message"].endswith("a rollback now would go back to the checkpoint of step 2")
    assert guard.rollback_target(run.checkpoint_steps(), 4) == 2


def save_checkpoint(run, steps_done, keep=2, protect=()):
    """A checkpoint as a save leaves it (a folder with files, the tracker last), then --keep-checkpoints' pruning."""
    folder = run.checkpoints / f"iter_{steps_done:07d}"
    folder.mkdir(parents=True)
    (folder / "rollout_state.json").write_text("{}")
    (run.checkpoints / "latest_checkpointed_iteration.txt").write_text(str(steps_done))
    run.prune_checkpoints(keep, protect)


def test_pruning_keeps_the_newest_checkpoints_set_aside_however_many_rollbacks_came_before(tmp_path):
    """Five rollbacks, each undoing one checkpoint, with --keep-checkpoints 2 pruning at every save: the two kept aside
    are always the two set aside last (pruning empties and removes older sets; a new set never reuses their number)."""
    run = RunFolder(tmp_path / "run")
    for k in (0, 10, 20, 30, 40, 50):
        save_checkpoint(run, k)
    undone = []
    for at, to, redo in ((55, 40, (50, 60, 70)), (75, 60, (70, 80, 90)), (95, 80, (90, 100, 110)),
                         (115, 100, (110, 120, 130)), (135, 120, (130, 140))):  # fmt: skip
        moved, where = run.set_aside(to, f"rollback-at-step-{at}")
        assert moved == [to + 10] and where.name.endswith(f"rollback-at-step-{at}")
        undone.append(f"{where.name}/iter_{to + 10:07d}")
        for k in redo:
            save_checkpoint(run, k)
        assert [f"{p.parent.name}/{p.name}" for p in run.undone_checkpoints()] == undone[-2:]
    numbers = [int(name.split("-")[0]) for name in undone]
    assert numbers == sorted(set(numbers))  # every set its own number, rising with its time


def test_a_second_rollback_at_the_same_step_sets_aside_beside_the_first(tmp_path):
    """The trouble came back step for step: two rollbacks decided at step 555, the second after pruning emptied an
    older set. Each gets a folder of its own; the first's checkpoint of step 540 and the redone one are both kept."""
    run = RunFolder(tmp_path / "run")
    for k in range(0, 220, 20):
        save_checkpoint(run, k)
    run.set_aside(180, "rollback-at-step-205")
    for k in range(200, 420, 20):
        save_checkpoint(run, k)
    run.set_aside(380, "rollback-at-step-405")
    for k in range(400, 560, 20):
        save_checkpoint(run, k, protect={500} if k >= 520 else ())
    _, first = run.set_aside(520, "rollback-at-step-555")
    save_checkpoint(run, 540, protect={500})  # redone; pruning empties the oldest set
    moved, second = run.set_aside(500, "rollback-at-step-555")
    assert moved == [520, 540] and second != first and run.latest_checkpoint() == 500
    assert run.checkpoint_steps()[-1] == 500
    assert (first / "iter_0000540").is_dir() and (second / "iter_0000540").is_dir()
    save_checkpoint(run, 520)  # redone again: pruning keeps the two set aside last
    assert [f"{p.parent.name}/{p.name}" for p in run.undone_checkpoints()] == [
        f"{second.name}/iter_0000520",
        f"{second.name}/iter_0000540",
    ]
