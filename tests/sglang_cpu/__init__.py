"""Real SGLang serving on this CPU machine, for the tests (the environment comes from tests/sglang_cpu/setup.sh).

SGLang runs in a virtual environment of its own (`.venv-sglang-cpu/`) with its CPU engine and pure-torch layers; the
project's code talks to it over HTTP exactly as it talks to SGLang on GPUs, and starts it with the project's own
launcher (slime_search.engines.sglang_launch), only with another interpreter and the CPU flags below.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from slime_search.engines.sglang_launch import SGLangEngineSpec, engine_process
from slime_search.utils.server_process import ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SGLANG_CPU_VENV", REPO_ROOT / ".venv-sglang-cpu"))
SHIMS = Path(__file__).resolve().parent / "shims"
# SGLang's CPU engine with pure-torch attention and sampling, no CUDA graphs, fp32 (so its log-probs are the
# trainer's), a small KV pool, and a scheduler that sleeps when idle instead of spinning on one of the two cores.
CPU_SERVER_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--dtype", "float32", "--max-total-tokens", "8192", "--random-seed", "0", "--sleep-on-idle",
)  # fmt: skip
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SHIMS), "OMP_NUM_THREADS": "1"}
START_TIMEOUT_S = 600.0  # 45-60 s on an idle 2-core machine; several minutes when other tests load it


def python() -> str:
    """The test venv's interpreter; skips the test (with the set-up command) when the venv was not built."""
    if not (VENV / "installed").is_file():
        pytest.skip(f"no SGLang test environment at {VENV}: run `bash tests/sglang_cpu/setup.sh` (README set-up)")
    return str(VENV / "bin" / "python")


# SGLang sizes its KV pool from the memory that is free before and after it loads the weights; on CPU that is the
# machine's, which other processes starting at the same time (the other test worker, the router test's second engine)
# also take. --max-total-tokens caps the pool at 8192 tokens whatever the fraction, so the fraction is only the margin
# for that: at 0.05, 0.53 GB taken elsewhere during the load was enough to refuse to start (measured on a loaded
# machine: "minimum viable 0.0693").
MEM_FRACTION_STATIC = 0.3


def engine_spec(model_path: str | Path, port: int, weight_version: str = "0") -> SGLangEngineSpec:
    return SGLangEngineSpec(
        str(model_path),
        port,
        mem_fraction_static=MEM_FRACTION_STATIC,
        weight_version=weight_version,
        extra_args=CPU_SERVER_ARGS,
    )


def start_engine(
    model_path: str | Path, port: int, log_path: Path | None = None, lora_rank: int | None = None
) -> ServerProcess:
    """A CPU engine; with `lora_rank`, serving LoRA adapters up to that rank on every projection (SGLang's
    torch_native LoRA backend, loaded through /load_lora_adapter)."""
    spec, env = engine_spec(model_path, port), CPU_ENV
    if lora_rank is not None:
        lora_args = ("--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(lora_rank),
                     "--lora-target-modules", "all", "--max-loras-per-batch", "2")  # fmt: skip
        spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, *lora_args))
        env = {**CPU_ENV, "SGLANG_CPU_UNPINNED": "1"}  # shims/sitecustomize.py: LoRA's index tensors, unpinned
    process = engine_process(spec, START_TIMEOUT_S, env, python(), log_path=log_path)
    process.wait_ready()
    return process
