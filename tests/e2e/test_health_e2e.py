"""What a run does about its faults, end to end on CPU (tiny policy, real retriever, CPU engine, Megatron under Ray):
a reward plugin that returns NaN stops it before anything is trained; an engine that serves stale weights shows as a
trainer-engine log-prob gap; a rollback goes back to the starting checkpoint with the learning rate halved, a run out of
rollbacks stops with the rule, the step and the value, and the same command resumes it with the remedy in force."""

import json
import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.health.verdict import verdict
from slime_search.search_r1.prompt import make_row
from tests.conftest import REPO_ROOT
from tests.e2e.faulty_plugins import EVAL_QUESTIONS, EVAL_SAMPLE
from tests.e2e.test_train_e2e import prepare_task, tiny_train_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_training(command, tmp_path, name):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # the Ray actors import the tests' plugins too
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    (tmp_path / f"{name}.log").write_text(result.stdout + result.stderr)
    return result


def records(run, kind="time/step_s"):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if kind in line] if path.exists() else []


def events(run):
    return [json.loads(line) for line in (run / "health.jsonl").read_text().splitlines()]


@pytest.fixture
def task(tmp_path):
    retriever_args = prepare_task(tmp_path)
    with RetrievalServerProcess(*retriever_args) as retriever:
        yield retriever.url


def test_a_nan_reward_stops_the_run_before_it_trains(tiny_checkpoint, tmp_path, task):
    command = tiny_train_command(
        tiny_checkpoint, tmp_path, task, "--num-rollout", "3", "--n-samples-per-prompt", "4",
        "--custom-rm-path", "tests.e2e.faulty_plugins.nan_for_sample_3",
    )  # fmt: skip
    result = run_training(command, tmp_path, "nan")
    assert result.returncode == 3, result.stderr[-3000:]  # the guard's stop, not a crash
    assert "run stopped: step 0: 2 of 8 rewards were not usable" in result.stderr
    assert "nan_for_sample_3 returned nan for sample 3" in result.stderr
    run = tmp_path / "run"
    assert records(run) == [] and not (run / "checkpoints").exists()  # nothing was trained, nothing saved
    assert verdict(events(run)).startswith("stopped at step 0")
    # tolerated below a rate, the bad samples leave the loss and the step trains on the rest
    tolerant = run_training([*command, "--max-reward-error-rate", "0.5", "--num-rollout", "1"], tmp_path, "tolerant")
    assert tolerant.returncode == 0, tolerant.stderr[-3000:]
    [step] = records(run)
    assert step["rollout/reward_errors"] == 2 and step["rollout/trainable"] == 6
    assert step["train/loss"] == step["train/loss"] and step["train/steps_applied"] == 1  # finite, applied


def test_an_engine_serving_stale_weights_is_probed_restarted_and_stops_the_run_naming_it(
    tiny_checkpoint, tmp_path, task
):
    """The CPU engine acknowledges version 2 on and keeps version 1's weights (also once restarted: the fault is in
    its flags). Its gap shows at step 2; with --health-patience 1 the weights are pushed again at once, the engine is
    probed against the actor, restarted, pushed and probed again, and the run stops naming it, on the newest
    checkpoint."""
    command = tiny_train_command(
        tiny_checkpoint, tmp_path, task, "--num-rollout", "4", "--lr", "1e-2", "--entropy-coef", "0.01",
        "--cpu-engine-args", "--freeze-weights-after 1", "--health-max-logprob-gap", "1e-3", "--health-patience", "1",
        "--save-interval", "1",
    )  # fmt: skip
    result = run_training(command, tmp_path, "stale")
    assert result.returncode == 3, result.stderr[-3000:]  # the guard's stop
    run = tmp_path / "run"
    steps = records(run)
    gaps = [s["health/logprob_gap_lag0"] for s in steps]
    # versions 0 and 1 are the weights the engine says; version 2 is claimed, version 1 served
    assert len(gaps) == 3 and gaps[0] < 1e-5 and gaps[1] < 1e-5 and gaps[2] > 1e-3
    acted = [(e["step"], e["action"], e["rule"]) for e in events(run) if e["action"] != "warn"]
    assert acted == [
        (2, "repush", "logprob_gap"),
        (2, "probe", "engine_mismatch"),
        (2, "restart_engine", "engine_mismatch"),
        (2, "stop", "engine_mismatch"),
    ], acted
    probe, stop = events(run)[-3], events(run)[-1]
    [url] = [key for key in probe["values"]]
    assert probe["values"][url] > 1e-3 and stop["values"][url] > 1e-3 and url in stop["message"]
    assert stop["values"]["ended_on"] == 2 and json.loads((run / "final.json").read_text())["step"] == 2
    assert "check the engine the message names" in result.stderr
    assert list(run.glob("engine.restart1.log"))  # the engine was started again


def test_a_rollback_restores_the_start_halves_the_lr_and_a_resume_keeps_the_remedy(tiny_checkpoint, tmp_path, task):
    run = tmp_path / "run"
    base = tiny_train_command(
        tiny_checkpoint, tmp_path, task, "--num-rollout", "2", "--lr", "1e-2", "--entropy-coef", "0.01",
        "--save-interval", "1", "--max-rollbacks", "1",
    )  # fmt: skip
    # every update "moves the policy too far": roll back once, then out of rollbacks: stop
    jumpy = [*base, "--health-max-update-kl", "1e-12"]
    result = run_training(jumpy, tmp_path, "jumpy")
    assert result.returncode == 3, result.stderr[-3000:]
    log = [e for e in events(run) if e["action"] != "warn"]  # (the tiny policy's rewards never differ: it warns so)
    actions = [(e["step"], e["action"], e["rule"]) for e in log]
    assert actions == [
        (0, "rollback", "policy_jump"),
        (0, "rollback", "policy_jump"),  # done: back to the checkpoint of step 0 (the starting weights)
        (0, "rollback", "policy_jump"),
        (0, "stop", "policy_jump"),
    ]
    assert log[1]["values"]["to_step"] == 0 and log[1]["values"]["lr_scale"] == 0.5
    assert "no rollback left (--max-rollbacks 1 within" in log[3]["message"] and "run stopped" in result.stderr
    assert "to go on: lower --lr" in result.stderr
    # the stopped run ends on its last healthy checkpoint: the starting weights, served and left in RUN/weights
    assert "ends on the checkpoint of step 0" in log[3]["message"] and log[3]["values"]["ended_on"] == 0
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_0"]
    left = load_file(run / "weights" / "step_0" / "model.safetensors")
    start = load_file(tiny_checkpoint / "model.safetensors")
    assert left.keys() == start.keys() and all(torch.equal(left[k], start[k]) for k in start)
    assert [s["train/lr"] for s in records(run)] == [5e-3]  # the step redone after the rollback, at half the lr
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 0 and final["checkpoint"] == "checkpoints/iter_0000000" and "policy_jump" in final["reason"]
    # the very same command again would stop the same way: it says what to change, before anything starts
    again = run_training(jumpy, tmp_path, "again")
    assert again.returncode == 3 and "Started again unchanged it would stop the same way" in again.stderr
    assert "Traceback" not in again.stderr and [s["step"] for s in records(run)] == [0]
    # the same command, with a bound the updates meet, resumes from the start with the remedy still in force
    resumed = run_training([*base, "--health-max-update-kl", "100"], tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [(s["step"], s["train/lr"]) for s in records(run)] == [(0, 5e-3), (1, 5e-3)]
    assert [e["action"] for e in events(run)].count("rollback") == 3  # history kept
    report = (run / "report" / "index.html").read_text()
    assert "rolled back 1 time" in report


def test_a_late_decline_ends_the_run_on_its_best_evaluated_checkpoint(tiny_checkpoint, tmp_path, task):
    run = tmp_path / "run"
    command = tiny_train_command(
        tiny_checkpoint, tmp_path, task, "--num-rollout", "2", "--lr", "1e-2", "--entropy-coef", "0.01",
        "--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "1",
        "--save-interval", "1", "--save-hf", "--keep-checkpoints", "1",
        "--custom-rm-path", "tests.e2e.faulty_plugins.right_until_version_1",
        # the drop must reach the end: no rollback on the way
        "--health-eval-drop", "5", "--health-reward-drop", "5",
    )  # fmt: skip
    result = run_training(command, tmp_path, "late")
    assert result.returncode == 0, result.stderr[-3000:]
    scores = [(r["step"], r["eval/score"]) for r in records(run, "eval/score")]
    assert scores == [(0, 1.0), (1, 1.0), (2, 0.0)]
    [end] = [e for e in events(run) if e["action"] == "end_on_best"]
    assert end["step"] == 2 and end["rule"] == "late_decline" and end["values"]["ended_on"] == 1.0
    # the best evaluated checkpoint outlived --keep-checkpoints 1; the engines serve it and RUN/weights holds it
    assert (run / "checkpoints" / "iter_0000001").is_dir() and (run / "hf" / "step_1").is_dir()
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1"]
    left = load_file(run / "weights" / "step_1" / "model.safetensors")
    best = load_file(run / "hf" / "step_1" / "model.safetensors")
    last = load_file(run / "hf" / "step_2" / "model.safetensors")
    assert left.keys() == best.keys() and all(torch.equal(left[k], best[k]) for k in best)
    assert not all(torch.equal(last[k], best[k]) for k in best)  # the last weights are others
    assert verdict(events(run)).endswith("the run ends on the checkpoint of step 1")
    assert json.loads((run / "final.json").read_text())["hf"] == "hf/step_1"  # the weights chosen, whatever transport


def late_fall_command(tiny_checkpoint, tmp_path, task, plugin: str) -> list[str]:
    """Two steps evaluated at every version on EVAL_SAMPLE of EVAL_QUESTIONS held-out questions; `plugin` grades
    versions 0 and 1 right and version 2 a fall of 0.25 on those (not beyond chance on 4 questions)."""
    questions = [
        make_row({"question": f"where does the otter number {i} live", "golden_answers": ["valley"]}, "nq", "test", i)
        for i in range(EVAL_QUESTIONS)
    ]
    pq.write_table(pa.Table.from_pylist(questions), tmp_path / "heldout.parquet")
    return tiny_train_command(
        tiny_checkpoint, tmp_path, task, "--num-rollout", "2", "--lr", "1e-2",
        "--eval-prompt-data", "nq", str(tmp_path / "heldout.parquet"), "--eval-interval", "1",
        "--eval-sample", str(EVAL_SAMPLE), "--save-interval", "1", "--keep-checkpoints", "1",
        "--custom-rm-path", f"tests.e2e.faulty_plugins.{plugin}",
        "--health-eval-drop", "5", "--health-reward-drop", "5",  # the fall must reach the end: no rollback
    )  # fmt: skip


def test_a_late_fall_the_evaluations_cannot_settle_is_confirmed_on_the_questions_they_left_out(
    tiny_checkpoint, tmp_path, task
):
    run = tmp_path / "run"
    result = run_training(late_fall_command(tiny_checkpoint, tmp_path, task, "declines_on_the_ungraded_questions"),
                          tmp_path, "confirmed")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["step"], r["eval/score"]) for r in records(run, "eval/score")] == [(0, 1.0), (1, 1.0), (2, 0.75)]
    [end] = [e for e in events(run) if e["action"] == "end_on_best"]
    fresh = EVAL_QUESTIONS - EVAL_SAMPLE
    assert end["values"]["ended_on"] == 1.0 and end["values"]["fresh_best"] == 1.0
    assert (
        end["values"]["fresh_final"] == 0.0 and f"on {fresh} questions the evaluations did not grade" in end["message"]
    )
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1"]  # the engines serve checkpoint 1
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 1 and final["checkpoint"] == "checkpoints/iter_0000001"
    assert (run / "checkpoints" / "iter_0000002").is_dir()  # the last weights stay on disk


def test_a_late_fall_the_left_out_questions_do_not_confirm_keeps_the_last_weights(tiny_checkpoint, tmp_path, task):
    run = tmp_path / "run"
    result = run_training(late_fall_command(tiny_checkpoint, tmp_path, task, "holds_on_the_ungraded_questions"),
                          tmp_path, "unconfirmed")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["step"], r["eval/score"]) for r in records(run, "eval/score")] == [(0, 1.0), (1, 1.0), (2, 0.75)]
    assert not [e for e in events(run) if e["action"] == "end_on_best"]
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == 2 and "not confirmed on 12 questions the evaluations did not grade" in final["reason"]
    assert "(the final weights 1.000 against 1.000 for the checkpoint of step 1)" in final["reason"]
    # the checkpoint was served for its evaluation, then the last weights again
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_2"]
