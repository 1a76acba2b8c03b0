"""A checkpoint round trip as a run makes it, on the tiny Qwen2: convert, train, save, resume. One JSON line.

    python -m tools.gpu_check.checkpoint          # CUDA: the bf16 actor
    python -m tools.gpu_check.checkpoint --cpu    # CPU: the fp32 actor (bf16 trains on GPU only)

A part of `tools.gpu_check.kit`. An HF checkpoint is converted by `tools/convert_hf_to_torch_dist.py` (fp32, TP 1, in a
process of its own, as a user runs it) and loaded into the recipe's actor (`--load`, the recipe's flags for the tiny
model). One step, `save_actor`, a second step; then a fresh actor (built anew, the converted weights loaded, as a run
builds it) takes `load_actor` and the second step again. Recorded: whether the loaded weights and optimizer state equal
the saved actor's byte for byte, and whether the second steps agree bit for bit (loss, gradient norm, weights after).
Also the seconds of conversion, save and load, and every file's size; the optimizer state is most of a checkpoint.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def file_sizes(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path -> bytes), whatever the saver named them."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def exact_state(actor) -> list:
    """Host copies of the actor's weights and of every tensor its optimizer saves (the tiny model: exact copies)."""
    from tools.gpu_check.shared import tensors_in

    tensors = list(actor.model.parameters()) + tensors_in(actor.optimizer.state_dict())
    return [t.detach().to("cpu", copy=True) for t in tensors]


def same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def convert(hf: Path, out: Path) -> float:
    """tools/convert_hf_to_torch_dist.py with the tiny model's flags; seconds."""
    from benchmarks.harness.paths import REPO
    from benchmarks.harness.recipe import CPU_MODEL, model_flags

    command = [sys.executable, str(REPO / "tools" / "convert_hf_to_torch_dist.py"), *model_flags(CPU_MODEL)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--hf-checkpoint", str(hf), "--save", str(out)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"the converter failed ({done.returncode}): {done.stderr[-1500:]}")
    return round(time.perf_counter() - started, 2)


def loaded_actor(recipe, converted: Path):
    """The recipe's actor with the converted weights (`--load`): built, loaded, then wrapped, as a run builds it."""
    from slime_search.backends.megatron.actor import MegatronActor
    from slime_search.backends.megatron.checkpoint import load_model
    from slime_search.backends.megatron.model import build_gpt_model

    model = build_gpt_model(recipe.shape, recipe.options)
    load_model(model, converted)
    return MegatronActor(model, recipe.actor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.harness.recipe import CPU_MODEL
    from slime_search.backends.megatron.checkpoint import load_actor, save_actor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.utils.net import free_port
    from tools.gpu_check.megatron_checks import fixed_batch
    from tools.gpu_check.shared import emit, prepare, recipe_on_one_device

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    recipe = recipe_on_one_device(CPU_MODEL, cpu=not cuda)
    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny_checkpoint(Path(tmp) / "hf")
        converted, run = Path(tmp) / "hf_torch_dist", Path(tmp) / "run"
        convert_s = convert(hf, converted)
        init_megatron(0, 1, tp_size=1, master_port=free_port(), seed=1234)
        first = loaded_actor(recipe, converted)
        samples = fixed_batch()
        prepare(first, None, samples)
        for sample in samples:  # the reference is the converted weights: the first actor's log-probs before a step
            sample.ref_log_probs = sample.old_log_probs
        first.train_step(samples)
        started = time.perf_counter()
        save_actor(first, run, 1)
        save_s = round(time.perf_counter() - started, 2)
        saved = exact_state(first)
        continued = first.train_step(samples)
        continued_weights = [p.detach().cpu().clone() for p in first.model.parameters()]

        resumed = loaded_actor(recipe, converted)
        started = time.perf_counter()
        iteration = load_actor(resumed, run)
        load_s = round(time.perf_counter() - started, 2)
        loaded = exact_state(resumed)
        again = resumed.train_step(samples)
        again_weights = [p.detach().cpu().clone() for p in resumed.model.parameters()]
        emit(
            {
                "part": "checkpoint",
                **recipe.summary(),
                "converted": "fp32 torch_dist from an fp32 HF checkpoint",
                "iteration_loaded": iteration,
                "weights_and_optimizer_equal_after_load": same(saved, loaded),
                "tensors_compared": len(saved),
                "second_step": {
                    "continued": {"loss": continued["loss"], "grad_norm": continued["grad_norm"]},
                    "resumed": {"loss": again["loss"], "grad_norm": again["grad_norm"]},
                },
                "second_step_bit_identical": (continued["loss"], continued["grad_norm"])
                == (again["loss"], again["grad_norm"])
                and same(continued_weights, again_weights),
                "convert_s": convert_s,
                "save_s": save_s,
                "load_s": load_s,
                "converted_bytes": sum(file_sizes(converted).values()),
                "checkpoint_bytes": sum(file_sizes(run).values()),
                "checkpoint_files": file_sizes(run),
            }
        )
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
