"""End to end on CPU: real retriever, CPU engine, Megatron ranks under Ray, weight sync by disk, eval, metrics,
checkpoint and resume with the same command."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.prompt import make_row
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(900)


def load_file_once(path):
    from safetensors.torch import load_file

    return load_file(path)


def test_two_grpo_steps_update_the_engine_and_write_metrics(tiny_checkpoint, tmp_path):
    import ray

    from slime_search.train import main

    write_tiny_corpus(tmp_path / "corpus.jsonl")
    assert (
        build_index.main(
            ["--retriever-name", "bm25", "--corpus-path", str(tmp_path / "corpus.jsonl"), "--save-dir", str(tmp_path)]
        )
        == 0
    )
    rows = [
        make_row({"question": f"where does the {c} otter live", "golden_answers": ["valley"]}, "nq", "train", i)
        for i, c in enumerate(["red", "blue", "green", "black"])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "eval.parquet")
    run = tmp_path / "run"

    def train(num_rollout):
        return main(
            [
                "--hf-checkpoint", str(tiny_checkpoint), "--save", str(run),
                "--prompt-data", str(tmp_path / "train.parquet"), "--apply-chat-template", "--rollout-shuffle",
                "--num-rollout", str(num_rollout), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                "--rollout-max-response-len", "8", "--max-response-tokens", "24", "--max-turns", "1",
                "--search-url", f"{retriever.url}/retrieve", "--lr", "1e-2", "--entropy-coef", "0.01",
                "--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "1", "--save-interval", "1",
            ]
        )  # fmt: skip

    with RetrievalServerProcess(
        "--retriever-name",
        "bm25",
        "--index-path",
        str(tmp_path / "bm25"),
        "--corpus-path",
        str(tmp_path / "corpus.jsonl"),
    ) as retriever:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            # a run stopped after step 1, then the same command asked for 2 steps: it resumes at step 2
            assert train(1) == 0
            first_weights = load_file_once(run / "weights" / "step_1" / "model.safetensors")
            code = train(2)
        finally:
            ray.shutdown()
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and [r["weight_version"] for r in records] == [1, 2]
    for record in records:
        assert {
            "train/loss",
            "train/grad_norm",
            "rollout/groups",
            "eval/nq/em",
            "time/rollout_s",
            "time/train_s",
        } <= set(record)
    before = load_file_once(tiny_checkpoint / "model.safetensors")
    after = load_file_once(run / "weights" / "step_2" / "model.safetensors")
    # a random policy earns no reward (zero advantages), so the entropy term is what moves the weights here
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the resumed run re-synced the step-1 checkpoint (identical weights) and step 2 moved on from it
    resynced = load_file_once(run / "weights" / "step_1" / "model.safetensors")
    assert all(torch.equal(first_weights[k], v) for k, v in resynced.items())
    assert any(not torch.equal(first_weights[k], after[k]) for k in after)
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
