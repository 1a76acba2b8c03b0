"""The weight gather of a push at the recipe's scale: the actor's state streamed under HF names in buckets. One JSON
line.

    python -m tools.gpu_check.gather              # CUDA: Qwen2.5-3B at TP 1 (random weights), bf16, 512 MiB buckets
    python -m tools.gpu_check.gather --cpu        # CPU: the tiny Qwen2, fp32, 64 KiB buckets

A part of `tools.gpu_check.kit`. `iter_hf_buckets` on `actor.local_state_dict()`, as a trainer rank draws the buckets
of every push (`slime_search.weight_sync.rank`), holding one bucket at a time, with the recipe's
`--update-weight-buffer-size`. Two passes: the gather alone (what the broadcast transport sends), then the gather
with each bucket flattened as the tensor transport sends it. Per pass: seconds (the lower bound of `time/sync_s`),
buckets, tensors, bytes, and the device memory above the actor's own at the peak. The tensors sent must number the
model's parameters (a tied head is not sent).
"""

from __future__ import annotations

import argparse
import sys
import time


def draw(actor, recipe, bucket_bytes: int, flatten: bool) -> dict:
    """One pass over every bucket, each dropped before the next is drawn."""
    import torch

    from slime_search.backends.megatron.model import uses_te_names
    from slime_search.weight_sync.gather import iter_hf_buckets
    from tools.gpu_check.ipc import flatten_bucket
    from tools.gpu_check.shared import gib, peak_memory

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if cuda else 0
    buckets = tensors = elements = size = 0
    started = time.perf_counter()
    te_names = uses_te_names(actor.model.module)
    for bucket in iter_hf_buckets(actor.local_state_dict(), recipe.shape, te_names, bucket_bytes):
        flat = flatten_bucket(bucket)[0] if flatten else None
        buckets += 1
        tensors += len(bucket)
        elements += sum(t.numel() for _, t in bucket)
        size += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket, flat
    if cuda:
        torch.cuda.synchronize()
    record = {
        "flattened": flatten,
        "seconds": round(time.perf_counter() - started, 3),
        "buckets": buckets,
        "tensors": tensors,
        "elements": elements,
        "gib": gib(size),
        **peak_memory(),
    }
    if cuda:
        record["peak_above_actor_gib"] = gib(torch.cuda.max_memory_allocated() - held)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="default: the recipe's (CPU: 64 KiB)")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.harness.recipe import CPU_MODEL, GPU_MODEL
    from megatron_bridge.param_count import count_parameters
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.utils.net import free_port
    from tools.gpu_check.shared import build_actor, emit, out_of_memory, recipe_on_one_device

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    recipe = recipe_on_one_device(GPU_MODEL if cuda else CPU_MODEL, cpu=not cuda)
    bucket_bytes = args.bucket_bytes or (recipe.bucket_bytes if cuda else 1 << 16)
    init_megatron(0, 1, tp_size=1, master_port=free_port(), seed=1234)
    record = {"part": "gather", **recipe.summary(), "bucket_bytes": bucket_bytes}
    try:
        actor, _ = build_actor(recipe, with_reference=False)
        record["passes"] = [draw(actor, recipe, bucket_bytes, flatten) for flatten in (False, True)]
        record["parameters"] = count_parameters(recipe.shape)
        record["every_parameter_sent"] = all(p["elements"] == record["parameters"] for p in record["passes"])
    except torch.OutOfMemoryError as error:
        record["error"] = out_of_memory(error)
    emit(record)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
