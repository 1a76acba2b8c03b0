"""train.py end to end with real SGLang (on CPU) as the engine: two GRPO steps per weight transport (disk; broadcast
over a gloo group; tensor handles in shared memory), each push checked by the engine's own log-probs."""

import json
import sys

import pytest

from local_dense_retriever.launch import RetrievalServerProcess
from tests.e2e.test_train_e2e import prepare_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def sglang_train_command(engine_url: str, checkpoint, tmp_path, retriever_url: str, *flags: str) -> list[str]:
    """`train.py` on the tiny policy against a running engine, with `flags` added."""
    return [
        sys.executable, "-m", "slime_search.train",
        "--hf-checkpoint", str(checkpoint), "--save", str(tmp_path / "run"), "--engine-url", engine_url,
        "--prompt-data", str(tmp_path / "train.parquet"), "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-turns", "1",
        "--search-url", f"{retriever_url}/retrieve", "--lr", "1e-2", "--update-weight-buffer-size", str(1 << 20),
        *flags,
    ]  # fmt: skip


def train_against(sglang_engine, checkpoint, tmp_path, *flags: str) -> list[dict]:
    """Run `train.py` against the shared SGLang engine (given back its start weights first); the per-step records."""
    import subprocess

    sglang_engine.reset()
    retriever_args = prepare_task(tmp_path)
    with RetrievalServerProcess(*retriever_args) as retriever:
        command = sglang_train_command(sglang_engine.url, checkpoint, tmp_path, retriever.url, *flags)
        done = subprocess.run(command, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/loss" in record]


@pytest.mark.parametrize("transport", ["disk", "nccl", "tensor"])
def test_grpo_steps_with_sglang_serving_each_pushed_version(transport, sglang_engine, tiny_checkpoint, tmp_path):
    train = train_against(
        sglang_engine, tiny_checkpoint, tmp_path,
        "--num-rollout", "2", "--rollout-max-response-len", "8", "--max-response-tokens", "24",
        "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--entropy-coef", "0.01",  # the policy moves even when every group's rewards tie
        "--update-weight-transport", transport,
    )  # fmt: skip
    assert [r["weight_version"] for r in train] == [1, 2]  # what SGLang's /model_info served after each push
    assert [r["rollout/weight_version"] for r in train] == [0, 1]  # what its /generate reported
    # step 1's rollout was sampled by SGLang from the weights pushed after step 0: the trainer's forward gives the
    # same log-probs to its tokens, although the policy already moved away from the reference (KL > 0)
    diffs, kls = [r["train/train_rollout_logprob_abs_diff"] for r in train], [r["train/kl_loss"] for r in train]
    assert max(diffs) < 1e-3 and kls[1] > 100 * max(diffs), (diffs, kls)


# Over tensor handles only: a Qwen3 policy's broadcast to SGLang is held by the engine contract
# (tests/engines/test_engine_contract_qwen3.py) and by the Qwen3 run against the CPU engine (test_train_e2e.py); its
# HF export, which the disk transport writes, by the bit-exact conversion round trip (tests/backends/
# test_megatron_convert.py, qwen3); SGLang's reload of such a folder by the Qwen2 run above over disk.
def test_qwen3_with_native_tool_calls_trains_against_sglang_serving_each_pushed_version(
    sglang_qwen3_engine, tiny_qwen3_checkpoint, tmp_path
):
    """A Qwen3 policy (q/k norms, its own head size, Qwen3's tokenizer and template) served by real SGLang, prompted
    with the search tool declared by the template: every pushed tensor reaches SGLang, whose log-probs of the next
    rollout are the trainer's."""
    train = train_against(
        sglang_qwen3_engine, tiny_qwen3_checkpoint, tmp_path,
        "--num-rollout", "2", "--rollout-max-response-len", "8", "--max-response-tokens", "24",
        "--use-kl-loss", "--kl-loss-coef", "0.001", "--entropy-coef", "0.01", "--tool-format", "qwen3",
        "--update-weight-transport", "tensor",
    )  # fmt: skip
    assert [r["weight_version"] for r in train] == [1, 2] and [r["rollout/weight_version"] for r in train] == [0, 1]
    diffs, kls = [r["train/train_rollout_logprob_abs_diff"] for r in train], [r["train/kl_loss"] for r in train]
    assert max(diffs) < 1e-3 and kls[1] > 100 * max(diffs), (diffs, kls)


def test_fully_asynchronous_grpo_pauses_sglang_for_each_broadcast(sglang_engine, tiny_checkpoint, tmp_path):
    """--async-mode fully with real SGLang: each push pauses the engine (retract), broadcasts inside SGLang's
    weight-update session (its last bucket flushes the cache, which SGLang allows only with no running request) and
    continues it; every token of every batch names the version that generated it, none newer than the policy that
    trains on it."""
    train = train_against(
        sglang_engine, tiny_checkpoint, tmp_path,
        "--num-rollout", "3", "--rollout-max-response-len", "96", "--max-response-tokens", "192",
        "--entropy-coef", "0.01", "--update-weight-transport", "nccl", "--async-mode", "fully", "--max-staleness", "2",
    )  # fmt: skip
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    for step, record in enumerate(train):
        lags = [int(k.rsplit("_", 1)[1]) for k in record if k.startswith("async/staleness_tokens_lag_")]
        assert lags and all(0 <= lag <= step for lag in lags), record  # versions 0..step generated its batch
