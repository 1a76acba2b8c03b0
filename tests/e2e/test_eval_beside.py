"""--eval-engine end to end on CPU: evaluation on an engine of its own, beside training, gives what the evaluation
inside the step gives, version by version."""

import json
import subprocess

import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from tests.e2e.test_train_e2e import prepare_task, tiny_train_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def records_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def eval_texts(run) -> dict[int, list[str]]:
    """Each evaluated version's responses, in eval-set order."""
    texts: dict[int, list[str]] = {}
    for line in (run / "rollouts.jsonl").read_text().splitlines():
        example = json.loads(line)
        if example["kind"] == "eval":
            texts.setdefault(example["step"], []).append(json.dumps(example["segments"]))
    return texts


def test_evaluation_beside_training_equals_evaluation_inside_it(tiny_checkpoint, tmp_path):
    """The same two GRPO steps (lr 1e-2: every version answers differently), evaluated after every step inside
    the step and then beside it: the eval engine evaluated exactly the weights of each version (greedy decoding gives
    the same responses and metrics), the records are under the versions they evaluated, the steps paid only for
    writing the weights, and nothing of the hand-over is left on disk."""
    retriever_args = prepare_task(tmp_path)
    flags = [
        "--num-rollout", "2", "--lr", "1e-2", "--entropy-coef", "0.01", "--rollout-shuffle",
        "--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "1",
    ]  # fmt: skip
    runs = {}
    with RetrievalServerProcess(*retriever_args) as retriever:
        for name, extra in (("inside", []), ("beside", ["--eval-engine"])):
            command = tiny_train_command(tiny_checkpoint, tmp_path, retriever.url, *flags, *extra)
            command[command.index("--save") + 1] = str(tmp_path / name)
            done = subprocess.run(command, capture_output=True, text=True, timeout=800)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            runs[name] = tmp_path / name

    inside, beside = (records_of(runs[name]) for name in ("inside", "beside"))
    evals = {name: {r["step"]: r for r in records if "eval/em" in r} for name, records in (("inside", inside), ("beside", beside))}  # fmt: skip
    assert sorted(evals["inside"]) == sorted(evals["beside"]) == [0, 1, 2]
    for version, record in evals["beside"].items():
        same = {k: v for k, v in record.items() if k.startswith("eval/") and "wait" not in k and "lag" not in k}
        assert same.items() >= {k: v for k, v in evals["inside"][version].items() if k in same}.items()
        assert record["weight_version"] == version and record["eval/lag_steps"] >= 0
        assert record["time/eval_s"] > 0 and record["time/eval_load_s"] > 0
    texts = {name: eval_texts(run) for name, run in runs.items()}
    assert texts["beside"] == texts["inside"]
    assert texts["beside"][0] != texts["beside"][2]  # the versions differ: a stale engine would be caught

    steps = [r for r in beside if "train/loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["time/eval_handover_s"] > 0 for r in steps)
    assert not any("time/eval_s" in r for r in steps)
    assert (runs["beside"] / "eval_engine" / "engine.log").is_file()
    assert not list((runs["beside"] / "eval_weights").iterdir())  # every hand-over folder removed once evaluated
