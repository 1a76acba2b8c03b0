"""The colocated hand-over at the recipe's scale: the actor and its KL reference give their device memory to the host
and take it back, twice. One JSON line.

    python -m tools.gpu_check.handover            # CUDA: Qwen2.5-3B at TP 1 (random weights), bf16
    python -m tools.gpu_check.handover --cpu      # CPU: the tiny Qwen2, fp32 (host copies, no device figures)

A part of `tools.gpu_check.kit`. The recipe with `COLOCATE=1` (`tools.gpu_check.shared`). One small step first, so that
the optimizer holds its moments; then two rounds of `offload()` / `onload()`, actor then reference, as a colocated rank
does around each rollout (the first round allocates and pins the host buffers, the second reuses them). Per round:
seconds each way, bytes handed over, and the host memory the process gained. `torch.cuda.mem_get_info()` before, while
handed over and after: is the memory really free for an engine? And whether the weights, the optimizer state and the
reference are byte for byte what they were (`fingerprint`, since a 50 GiB state has no room for a copy). Then one more
step, which must be applied.
"""

from __future__ import annotations

import argparse
import sys
import time


def hand_over(models) -> dict:
    """One round trip of every model's memory; seconds, bytes and memory on each side."""
    import torch

    from tools.gpu_check.shared import device_memory, gib

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the fingerprints' temporaries are not the actor's: not counted as freed
    before = device_memory()
    started = time.perf_counter()
    handed = sum(model.offload() for model in models)
    offload_s = time.perf_counter() - started
    offloaded = device_memory()
    started = time.perf_counter()
    restored = sum(model.onload() for model in models)
    onload_s = time.perf_counter() - started
    after = device_memory()
    record = {
        "offload_s": round(offload_s, 2),
        "onload_s": round(onload_s, 2),
        "gib_handed": gib(handed),
        "gib_restored": gib(restored),
        "before": before,
        "offloaded": offloaded,
        "after": after,
    }
    if "device_free_gib" in before:
        # what an engine on the same GPU could take while the actor is handed over, and the pinned host buffers
        # (allocated by the first round, reused by the later ones); on CPU the state moves within host memory
        record["device_gib_freed"] = round(offloaded["device_free_gib"] - before["device_free_gib"], 2)
        record["host_gib_gained"] = round(offloaded["host_resident_gib"] - before["host_resident_gib"], 2)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from benchmarks.harness.recipe import CPU_MODEL, GPU_MODEL
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.utils.net import free_port
    from tools.gpu_check.shared import (
        build_actor,
        emit,
        out_of_memory,
        prepare,
        recipe_on_one_device,
        samples_of,
        state_fingerprints,
    )

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    recipe = recipe_on_one_device(GPU_MODEL if cuda else CPU_MODEL, cpu=not cuda, env={"COLOCATE": "1"})
    init_megatron(0, 1, tp_size=1, master_port=free_port(), seed=1234)
    record = {"part": "handover", **recipe.summary()}
    try:
        actor, reference = build_actor(recipe, with_reference=recipe.with_reference)
        models = [m for m in (actor, reference) if m is not None]  # the order a colocated rank hands them over
        samples = samples_of(2, 128, 256, recipe.shape.vocab_size)
        prepare(actor, reference, samples)
        record["first_step_applied"] = actor.train_step(samples)["step_applied"]
        expected = state_fingerprints(actor, reference)
        record["tensors_fingerprinted"] = {name: len(values) for name, values in expected.items()}
        record["rounds"] = []
        for _ in range(args.rounds):
            round_trip = hand_over(models)
            found = state_fingerprints(actor, reference)
            round_trip["bit_exact"] = {name: found[name] == expected[name] for name in expected}
            record["rounds"].append(round_trip)
        prepare(actor, reference, samples)
        after = actor.train_step(samples)
        record["step_after"] = {k: after[k] for k in ("loss", "grad_norm", "step_applied")}
    except torch.OutOfMemoryError as error:
        record["error"] = out_of_memory(error)
    emit(record)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
