"""Three GRPO steps on CPU with slime's own Search-R1 plugin (examples/search-r1/generate_with_search.py at slime
624b824, from ../shared/compat), given by slime's flags: the real retriever, the CPU engine, Megatron under Ray,
weight sync by disk. slime is not installed; its plugin API comes from slime_search.compat. slime's TIS/MIS helper
is in the loss (examples/train_infer_mismatch_helper: --custom-config-path mis.yaml
--custom-tis-function-path ...mis.compute_mis_weights_with_cp), as slime's run script's commented lines give it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from local_dense_retriever.launch import RetrievalServerProcess
from tests.backends.test_megatron_custom_tis import slime_examples_root
from tests.compat.conftest import MIS, SEARCH_R1, require_slime_files
from tests.conftest import REPO_ROOT
from tests.e2e.test_train_e2e import load_weights, prepare_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What a slime user edits in generate_with_search.py: the address of the local retriever.
CONFIG_MODULE = """import generate_with_search

generate_with_search.SEARCH_R1_CONFIGS["local"]["search_url"] = {url!r}
from generate_with_search import generate, reward_func  # noqa: E402,F401
"""


def train_with_slimes_plugin(checkpoint, tmp_path, *flags: str) -> list[dict]:
    """Three steps of slime's Search-R1 plugin with `flags` added; the training records of metrics.jsonl."""
    require_slime_files()
    retriever_args = prepare_task(tmp_path)
    run = tmp_path / "run"
    with RetrievalServerProcess(*retriever_args) as retriever:
        (tmp_path / "slime_search_config.py").write_text(CONFIG_MODULE.format(url=f"{retriever.url}/retrieve"))
        command = [
            sys.executable, "-m", "slime_search.train",
            "--hf-checkpoint", str(checkpoint), "--save", str(run),
            "--prompt-data", str(tmp_path / "train.parquet"), "--input-key", "prompt", "--label-key", "reward_model",
            "--apply-chat-template", "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--lr", "1e-2", "--entropy-coef", "0.01",
            "--custom-generate-function-path", "slime_search_config.generate",
            "--custom-rm-path", "slime_search_config.reward_func", *flags,
        ]  # fmt: skip
        # slime's run script puts the example's folder on PYTHONPATH, and runs from slime's checkout (from which
        # examples.train_infer_mismatch_helper imports); the Ray workers inherit it
        path = [tmp_path, SEARCH_R1, slime_examples_root(tmp_path), REPO_ROOT]
        path = os.pathsep.join(str(folder) for folder in path)
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONPATH": path}
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/loss" in r]


# What slime's helper logs with mis.yaml's settings (token TIS truncated at 2, token rejection, veto, batch
# normalisation), under slime's names, and slime's ratio to the old policy.
MIS_METRICS = (
    "train/mis_kl", "train/mis_k3_kl", "train/mis_training_ppl", "train/mis_rollout_ppl", "train/mis_chi2_token",
    "train/mis_tis_weight_before_bound", "train/mis_tis_truncate_fraction", "train/mis_tis_weight_after_bound",
    "train/mis_rs_mask_fraction_low", "train/mis_rs_mask_fraction_high", "train/mis_rs_catastrophic_token_fraction",
    "train/mis_batch_norm_factor", "train/mis_is_ratio_mean_final", "train/ois",
)  # fmt: skip


def test_grpo_steps_with_slimes_search_plugin_and_tis_helper(tiny_checkpoint, tmp_path):
    """slime's plugin trains (its samples reach the trainer as slime means them), and slime's run script's TIS lines
    act: mis.yaml's keys on the flags (use_tis: true among them), its compute_mis_weights_with_cp called by every rank
    on every micro-batch, its metrics in every step's record. One run for both: the set-up is the cost."""
    mis = ["--custom-config-path", str(MIS / "mis.yaml")]
    mis += ["--custom-tis-function-path", "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"]
    train = train_with_slimes_plugin(tiny_checkpoint, tmp_path, *mis)
    run = tmp_path / "run"
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in train] == [0, 1, 2]
    assert all(r["rollout/trainable"] == 4.0 and r["rollout/failed"] == 0.0 for r in train)
    # the tokens and log-probs slime's plugin collected are the engine's: the trainer's log-probs of them agree
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in train) < 1e-3
    before = load_weights(tiny_checkpoint / "model.safetensors")
    after = load_weights(run / "weights" / "step_3" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (run / "rollout_manager.log").read_text().count("slime is not installed") == 1
    examples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert examples and all(e["segments"] and e["segments"][0][1] is True for e in examples)
    for record in train:
        missing = [name for name in MIS_METRICS if name not in record]
        assert not missing, (record["step"], missing)
        assert "train/tis_weight_mean" not in record  # the helper takes vanilla TIS's place
    # the engine's log-probs are the trainer's: before the update every weight is 1, none truncated or rejected
    assert all(r["train/mis_tis_truncate_fraction"] == 0 and r["train/mis_rs_mask_fraction_low"] == 0 for r in train)
    assert all(abs(r["train/mis_batch_norm_factor"] - 1) < 1e-3 for r in train)
