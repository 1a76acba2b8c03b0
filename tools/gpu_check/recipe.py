"""The 3B recipe's training step on one device at TP 1, built from the recipe's own flags: one JSON line.

    python -m tools.gpu_check.recipe              # CUDA: Qwen2.5-3B (random weights), as run_qwen2.5_3B.sh sets it
    python -m tools.gpu_check.recipe --cpu        # CPU: the same flags with the tiny Qwen2 (fp32)
    python -m tools.gpu_check.recipe --env RECIPE=search-r1   # the script's other recipe

A part of `tools.gpu_check.kit`. The flags are what `DRY_RUN=1 bash examples/search-r1/run_qwen2.5_3B.sh` prints
(`benchmarks.harness.recipe`). They give bf16 and the attention `--attention-impl auto` resolves to here (packed without
TransformerEngine). They give full uniform recompute of 1 layer and `--max-tokens-per-gpu 9216`. The optimizer is the
one run_config builds (not the distributed one), with the KL reference beside the actor and the health probe after the
update. At TP 1, without sequence parallelism. A step is what the driver does per optimizer step: the old policy's
log-probs, the reference's, then the update; the first is a warm-up (Adam's moments are allocated in it). Records each
phase's seconds, the device's peak memory and its total, so the margin shows whether TP 1 fits the card. Samples: 16 of
1,024-2,048 tokens on CUDA (26,586 tokens: the figures of docs/benchmarks/megatron.md used the same), 4 of 32-64 on CPU.
"""

from __future__ import annotations

import argparse
import sys
import time


def timed(function, *args):
    """(result, seconds), the device's queue drained on both sides."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = function(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, round(time.perf_counter() - started, 3)


def one_step(actor, reference, samples) -> dict:
    """The driver's prepare (old and reference log-probs), then one optimizer step; each phase's seconds."""
    old, old_s = timed(actor.compute_log_probs, samples)
    for sample, values in zip(samples, old, strict=True):
        sample.old_log_probs = values
    ref_s = None
    if reference is not None:
        ref, ref_s = timed(reference.compute_log_probs, samples)
        for sample, values in zip(samples, ref, strict=True):
            sample.ref_log_probs = values
    metrics, train_s = timed(actor.train_step, samples)
    keys = ("loss", "grad_norm", "step_applied", "kl_loss", "kl_old_new")
    return {
        "old_log_probs_s": old_s,
        "ref_log_probs_s": ref_s,
        "train_step_s": train_s,
        "step_s": round(old_s + (ref_s or 0.0) + train_s, 3),
        **{k: metrics[k] for k in keys if k in metrics},
    }


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env takes NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU, fp32")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (CUDA: 16, CPU: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="longest sample; the shortest is half of it")
    parser.add_argument("--steps", type=int, default=2, help="steps, the first a warm-up")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the recipe script (repeatable)")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.harness.recipe import CPU_MODEL, GPU_MODEL
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.utils.net import free_port
    from tools.gpu_check.shared import (
        build_actor,
        device_memory,
        emit,
        out_of_memory,
        peak_memory,
        recipe_on_one_device,
        samples_of,
    )

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    env = parse_env(args.env)
    recipe = recipe_on_one_device(GPU_MODEL if cuda else CPU_MODEL, cpu=not cuda, env=env)
    init_megatron(0, 1, tp_size=1, master_port=free_port(), seed=1234)
    seq_len = args.seq_len or (2048 if cuda else 64)
    samples = samples_of(args.samples or (16 if cuda else 4), seq_len // 2, seq_len, recipe.shape.vocab_size)
    record = {
        "part": "recipe_step",
        "recipe_env": env,
        **recipe.summary(),
        "samples": len(samples),
        "tokens_per_step": sum(len(s.tokens) for s in samples),
    }
    try:
        actor, reference = build_actor(recipe, with_reference=recipe.with_reference)
        record["after_build"] = device_memory()  # the actor's state and the reference, before any step
        record["steps"] = [one_step(actor, reference, samples) for _ in range(args.steps)]
        last = record["steps"][-1]
        record["tokens_per_s"] = round(record["tokens_per_step"] / last["step_s"], 1)
    except torch.OutOfMemoryError as error:
        record["error"] = out_of_memory(error)
    record.update(peak_memory())
    emit(record)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
