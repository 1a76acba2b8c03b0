"""End to end on CPU: real retriever, CPU engine, Megatron ranks under Ray, weight sync by disk, eval, metrics;
the run is killed (SIGKILL) mid-way and the same command continues it from the last complete checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.prompt import make_row
from tests.conftest import REPO_ROOT
from tests.retriever_helpers import write_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def load_weights(path):
    from safetensors.torch import load_file

    return load_file(path)


def wait_for_checkpoint(run, proc, iteration: int, timeout_s: float = 600) -> None:
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tracker.is_file() and tracker.read_text().strip() == str(iteration):
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"training exited early with {proc.returncode}: {(run.parent / 'log1.txt').read_text()}"
            )
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint {iteration} within {timeout_s} s")


def prepare_task(tmp_path):
    """A BM25 index over the tiny corpus, 4 training and 2 eval prompts; returns the retriever's arguments."""
    write_tiny_corpus(tmp_path / "corpus.jsonl")
    index_args = ["--retriever-name", "bm25", "--corpus-path", str(tmp_path / "corpus.jsonl"), "--save-dir"]
    assert build_index.main([*index_args, str(tmp_path)]) == 0
    rows = [
        make_row({"question": f"where does the {c} otter live", "golden_answers": ["valley"]}, "nq", "train", i)
        for i, c in enumerate(["red", "blue", "green", "black"])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "eval.parquet")
    return [
        "--retriever-name",
        "bm25",
        "--index-path",
        str(tmp_path / "bm25"),
        "--corpus-path",
        str(tmp_path / "corpus.jsonl"),
    ]


def tiny_train_command(checkpoint, tmp_path, retriever_url: str, *flags: str) -> list[str]:
    """`train.py` on the tiny policy and the task of `prepare_task`, run folder tmp_path/run, with `flags` added."""
    return [
        sys.executable, "-m", "slime_search.train",
        "--hf-checkpoint", str(checkpoint), "--save", str(tmp_path / "run"),
        "--prompt-data", str(tmp_path / "train.parquet"), "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--max-response-tokens", "24", "--max-turns", "1",
        "--search-url", f"{retriever_url}/retrieve", *flags,
    ]  # fmt: skip


def test_grpo_run_killed_and_resumed_with_the_same_command(tiny_checkpoint, tmp_path):
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        command = tiny_train_command(
            tiny_checkpoint, tmp_path, retriever.url,
            "--rollout-shuffle", "--num-rollout", "3", "--lr", "1e-2", "--entropy-coef", "0.01",
            "--use-kl-loss", "--kl-loss-coef", "0.001",
            "--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "2", "--save-interval", "1",
            "--save-hf",
        )  # fmt: skip
        with open(tmp_path / "log1.txt", "w") as log:
            # its own session, so that SIGKILL reaches the driver and every process it started, and nothing else
            first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_checkpoint(run, first, 1)
            first_weights = load_weights(run / "weights" / "step_1" / "model.safetensors")
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        second = subprocess.run(command, capture_output=True, text=True, timeout=800)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/em" in r]
    assert [r["step"] for r in train] == [0, 1, 2]  # each step once, although step 1 (or 2) was cut off
    assert [r["weight_version"] for r in train] == [1, 2, 3]  # what the engine reported after each sync
    # the engine served version k to the rollout of step k: the resumed run re-synced the step-1 checkpoint
    assert [r["rollout/weight_version"] for r in train] == [0, 1, 2]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for record in train:
        assert {"train/loss", "train/kl_loss", "train/grad_norm", "rollout/groups", "time/rollout_s"} <= set(record)
        assert {"time/train_s", "time/sync_s", "rollout/searches_mean"} <= set(record)
    assert {"eval/nq/em", "eval/search_rate", "eval/turns"} <= set(evals[-1])

    before = load_weights(tiny_checkpoint / "model.safetensors")
    after = load_weights(run / "weights" / "step_3" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(first_weights[k], after[k]) for k in after)
    assert not (run / "weights" / "step_1").exists()  # only the newest synced copy is kept
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"
    kept = sorted(path.name for path in (run / "checkpoints").glob("iter_*"))
    # --keep-checkpoints 2 (the default) pruned step 1's; the starting weights (checkpoint 0) stay as the health
    # guard's rollback target until a later checkpoint has had --health-confirm-steps clean steps after it
    assert kept == ["iter_0000000", "iter_0000002", "iter_0000003"]
    # --save-hf: an HF folder beside every checkpoint kept, pruned with them; the last holds the weights pushed last
    assert sorted(path.name for path in (run / "hf").iterdir()) == ["step_0", "step_2", "step_3"]
    saved = load_weights(run / "hf" / "step_3" / "model.safetensors")
    assert saved.keys() == after.keys() and all(torch.equal(saved[k], after[k]) for k in after)
    assert (run / "hf" / "step_3" / "tokenizer.json").is_file() and (run / "hf" / "step_3" / "config.json").is_file()
    examples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({(e["kind"], e["step"]) for e in examples}) == [
        ("eval", 0), ("eval", 2), ("eval", 3), ("train", 0), ("train", 1), ("train", 2)
    ]  # fmt: skip
    assert all(e["segments"] and e["prompt"] for e in examples)


def tp2_command(tiny_checkpoint, tmp_path, retriever_url: str, num_rollout: int, *flags: str) -> list[str]:
    """GRPO steps of the tiny policy at TP 2 with 1 MiB weight-sync buckets, run folder tmp_path/run."""
    return [
        sys.executable, "-m", "slime_search.train",
        "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path / "run"),
        "--prompt-data", str(tmp_path / "train.parquet"), "--apply-chat-template",
        "--num-rollout", str(num_rollout), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--max-response-tokens", "24", "--max-turns", "1",
        "--search-url", f"{retriever_url}/retrieve", "--lr", "1e-2", "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--entropy-coef", "0.01",  # the policy moves even when every group's rewards tie
        "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
        "--update-weight-buffer-size", str(1 << 20), *flags,
    ]  # fmt: skip


def run_three_disk_free_steps(tiny_checkpoint, tmp_path, *flags: str, then=None) -> list[dict]:
    """Three GRPO steps of the tiny policy at TP 2 with 1 MiB weight-sync buckets; checks what every disk-free
    transport must give, and returns the metrics records. `then(retriever_url)`: more to run while the retriever is
    up, after the three steps."""
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        command = tp2_command(tiny_checkpoint, tmp_path, retriever.url, 3, *flags)
        done = subprocess.run(command, capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        if then is not None:
            then(retriever.url)
    train = [r for r in records if "train/loss" in r]
    assert [r["weight_version"] for r in train] == [1, 2, 3]  # what the engine reported after each push
    assert [r["rollout/weight_version"] for r in train] == [0, 1, 2]
    assert not (run / "weights").exists()  # nothing went through the disk
    # the engine sampled step k's rollout from the actor's weights after step k-1: Megatron's log-probs of those
    # tokens equal the engine's, although the policy moved away from its start (KL to the reference grows)
    diffs, kls = [r["train/train_rollout_logprob_abs_diff"] for r in train], [r["train/kl_loss"] for r in train]
    assert max(diffs) < 1e-3 and kls[2] > 100 * max(diffs), (diffs, kls)
    return records


def test_grpo_with_broadcast_weight_sync(tiny_checkpoint, tmp_path):
    """Tensor-parallel shards gathered on rank 0 and broadcast over gloo to the CPU engine after every step (the
    tensor-handle transport runs end to end in the colocated test below)."""
    run_three_disk_free_steps(tiny_checkpoint, tmp_path, "--update-weight-transport", "nccl")


def test_a_qwen3_policy_trains_and_its_pushed_weights_serve_the_trainers_log_probs(tiny_qwen3_checkpoint, tmp_path):
    """Qwen3 (q/k norms, no q/k/v bias, its own head size) through the whole loop at TP 2: the CPU engine serves it,
    the broadcast pushes carry every tensor (a q/k norm left behind would part engine and trainer log-probs). With the
    MIS token mask: engine and trainer agree, so it keeps every token at weight 1, and the run reports so."""
    mis = ["--use-mis", "--mis-mode", "mask", "--global-batch-size", "2"]  # two optimizer steps per rollout
    records = run_three_disk_free_steps(tiny_qwen3_checkpoint, tmp_path, "--update-weight-transport", "nccl", *mis)
    for step in (r for r in records if "train/loss" in r):
        assert step["train/steps"] == 2 and step["train/mis_mask_kept_fraction"] == 1.0, step
        # a synchronous run trains on tokens of the trainer's own version: all of them in the lag-0 bucket
        assert step["train/mis_masked_share_lag0"] == 0.0 and "train/mis_masked_share_lag1" not in step, step
        assert step["train/mis_weight_mean"] == pytest.approx(1.0, abs=1e-3), step
        assert 0.999 < step["train/mis_weight_min"] <= step["train/mis_weight_max"] < 1.001, step


def test_colocated_run_hands_memory_over_between_phases(tiny_checkpoint, tmp_path):
    """--colocate on CPU: the actor (TP 2) offloads before every rollout, the engine releases its weights before
    every step and gets them back only through a full push of shared-memory handles, bucket by bucket (it refuses
    to generate on half-updated weights)."""
    eval_flags = ["--eval-prompt-data", "nq", str(tmp_path / "eval.parquet"), "--eval-interval", "2"]
    records = run_three_disk_free_steps(
        tiny_checkpoint, tmp_path, "--colocate", "--save-interval", "2", "--save-hf", *eval_flags
    )
    # --save-hf at TP 2 with 1 MiB buckets: the HF folder is written shard by shard and loads as one model
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "run" / "hf" / "step_3"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).state_dict()
    assert saved.keys() == start.keys() and any(not torch.equal(saved[k], start[k]) for k in start)
    assert all(r["memory/actor_offloaded_gib"] > 0 for r in records if "train/loss" in r)
    assert [r["step"] for r in records if "eval/em" in r] == [0, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_a_retriever_that_is_down_stops_the_run_before_ray_starts(tiny_checkpoint, tmp_path):
    from slime_search.utils.net import free_port

    row = make_row({"question": "where does the red otter live", "golden_answers": ["valley"]}, "nq", "train", 0)
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    command = tiny_train_command(tiny_checkpoint, tmp_path, closed, "--num-rollout", "1")
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"preflight failed: cannot reach the retriever at {closed}/retrieve" in done.stderr
    assert time.monotonic() - started < 30  # seconds, not the minutes Ray, the engines and the models take
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()  # no run folder: nothing started


def test_a_lora_policy_trains_its_adapters_and_the_engine_serves_them_merged(tiny_checkpoint, tmp_path):
    """--lora-rank at TP 2: only the adapters train, each push carries the weights with the adapters folded in (the
    engine's log-probs equal the trainer's), and the KL reference is the same model with its adapters disabled (the
    KL grows from 0 as the adapters move). A checkpoint holds the adapters and their optimizer state only, and a run
    resumed from it goes on with the adapters it trained. It is resumed colocated, pushing the adapters alone: the
    engine keeps its base weights while the actor trains, so step 5's rollout is sampled from base + step 4's adapters
    (an engine that gave its weights up would get them back as zeros and refuse to generate). --save-hf writes the
    folded weights and a PEFT folder."""
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--save-hf"]
    resumed = {}

    def two_more_steps(retriever_url: str) -> None:
        colocated = ["--colocate", "--lora-sync-from-tensor"]
        command = tp2_command(tiny_checkpoint, tmp_path, retriever_url, 5, *lora, *colocated)
        resumed["done"] = subprocess.run(command, capture_output=True, text=True, timeout=800)

    merged_pushes = ["--update-weight-transport", "nccl"]
    records = run_three_disk_free_steps(tiny_checkpoint, tmp_path, *lora, *merged_pushes, then=two_more_steps)
    train = [r for r in records if "train/loss" in r]
    assert train[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the adapters start at zero: policy = base
    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "run" / "hf" / "step_3"
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000003"
    keys = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    assert "decoder.layers.self_attention.linear_qkv.linear_in.weight" in keys
    assert all(".linear_in." in k or ".linear_out." in k for k in keys), sorted(keys)[:5]  # no frozen weight
    stored = sum(path.stat().st_size for path in checkpoint.iterdir())
    folded = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    assert stored < 0.02 * folded  # the adapters and their Adam moments: kilobytes against the model's megabytes

    done = resumed["done"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed_steps = [r for r in again if "train/loss" in r][3:]  # the resumed run's two steps
    assert [r["weight_version"] for r in resumed_steps] == [4, 5]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in resumed_steps), resumed_steps
    assert all(r["memory/actor_offloaded_gib"] > 0 for r in resumed_steps)  # the hand-over ran
    # resumed with the trained adapters, the policy is still away from the base (reset adapters would give KL 0)
    assert resumed_steps[0]["train/kl_loss"] > 0.3 * train[2]["train/kl_loss"] > 0

    # --save-hf: the folded weights, and the adapters as a PEFT folder that loads onto the base model to the same model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 27).unsqueeze(0)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        adapted = PeftModel.from_pretrained(base, folder / "adapter").eval()(ids).logits
        start = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()(ids).logits
    assert (merged - start).abs().max().item() > 1e-3  # the adapters moved the policy
    assert (adapted - merged).abs().max().item() < 1e-4

    # tools/convert_lora_to_hf.py: the checkpoint of step 3 (trained at TP 2) to the same folders, at TP 1
    from safetensors.torch import load_file

    out = tmp_path / "converted"
    converted = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "convert_lora_to_hf.py"), "--load", str(checkpoint.parent),
         "--iteration", "3", "--save", str(out / "adapter"), "--save-merged", str(out / "merged")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text()) == json.loads(
        (folder / "adapter" / "adapter_config.json").read_text()
    )
    ours, run = (
        load_file(out / "adapter" / "adapter_model.safetensors"),
        load_file(folder / "adapter" / "adapter_model.safetensors"),
    )
    assert ours.keys() == run.keys() and all(torch.equal(ours[k], run[k]) for k in run)
    ours = load_file(out / "merged" / "model.safetensors")
    run = {k: v for shard in sorted(folder.glob("model-*.safetensors")) for k, v in load_file(shard).items()}
    assert ours.keys() == run.keys() and all(torch.allclose(ours[k], run[k], atol=1e-6) for k in run)
