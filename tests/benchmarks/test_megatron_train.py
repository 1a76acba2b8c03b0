"""The Megatron train-step benchmark at its smallest size: it needs a CUDA GPU, and without one says so."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)
SMALLEST = ["--num-layers", "2", "--hidden-size", "256", "--num-heads", "4", "--num-kv-heads", "2"]
SMALLEST += ["--intermediate-size", "512", "--samples", "2", "--seq-len", "64", "--steps", "1", "--offload"]


def run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.perf.megatron_train", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=540)


def test_without_cuda_it_refuses_with_a_reason():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the benchmark runs (test_a_step_runs_and_prints_its_figures)")
    done = run(*SMALLEST)
    assert done.returncode == 2 and "error: this benchmark needs a CUDA GPU" in done.stderr


@pytest.mark.gpu
def test_a_step_runs_and_prints_its_figures():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the benchmark times a bf16 step with the distributed optimizer")
    done = run(*SMALLEST)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["tokens_per_s"] > 0 and figures["step_s"] > 0 and 0 < figures["mfu"] < 1
    assert figures["last_step"]["step_applied"] and figures["peak_memory_gib"] > 0
    assert figures["handover_2"]["device_gib_while_offloaded"] < figures["handover_2"]["device_gib_before"]
