"""The device-path checks at their smallest size (one family): on a machine without CUDA they run on CPU in fp32,
the same checks a GPU runs, and every one prints its figures without an error."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_check_prints_its_figures():
    command = [sys.executable, "-m", "tools.gpu_check.megatron_checks", "--families", "qwen2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r for r in records if "error" in r] == []
    by_check = {r["check"]: r for r in records}
    assert set(by_check) == {"environment", "parity", "gather", "log_probs", "train", "attention"}
    assert by_check["parity"]["max_abs_logit_diff"] < 1e-3 * max(1.0, by_check["parity"]["logit_scale"])
    assert by_check["gather"]["tensors"] > 0 and by_check["gather"]["max_abs_diff"] == 0.0
    assert by_check["log_probs"]["max_abs_diff_vs_hf"] < 1e-3
    steps = by_check["train"]["steps"]
    assert len(steps) == 4 and all(step["loss"] is not None for step in steps)
    assert by_check["train"]["offload"]["bit_exact_after_onload"] is True
    # the packed attention against the local one, fp32 on CPU, with gradients large enough to compare
    attention = by_check["attention"]
    assert attention["max_abs_grad"] > 1e-3
    assert max(attention[k] for k in ("max_abs_logit_diff", "max_abs_log_prob_diff", "max_abs_grad_diff")) < 1e-5
