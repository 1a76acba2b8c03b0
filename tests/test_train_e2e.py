"""End to end on CPU: real retriever, CPU engine, Megatron ranks under Ray, weight sync by disk, eval, metrics.

Not yet covered here: checkpoint, kill and resume of the whole run (the actor's save/resume is tested on its own).
"""

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
            code = main(
                [
                    "--hf-checkpoint", str(tiny_checkpoint), "--save", str(run),
                    "--prompt-data", str(tmp_path / "train.parquet"), "--apply-chat-template",
                    "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                    "--rollout-max-response-len", "8", "--max-response-tokens", "24", "--max-turns", "1",
                    "--search-url", f"{retriever.url}/retrieve", "--lr", "1e-2", "--entropy-coef", "0.01",
                    "--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "1",
                ]
            )  # fmt: skip
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
    from safetensors.torch import load_file

    before, after = (
        load_file(tiny_checkpoint / "model.safetensors"),
        load_file(run / "weights" / "step_2" / "model.safetensors"),
    )
    # a random policy earns no reward (zero advantages), so the entropy term is what moves the weights here
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the engine was switched to each step's weights (update_engines_from_disk checks the reported version)
    assert (run / "weights" / "step_1" / "config.json").is_file()
