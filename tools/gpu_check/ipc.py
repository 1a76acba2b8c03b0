"""The tensor transport's bucket lifecycle between two processes on one device, with torch's own reductions: one JSON
line per push and one summary.

    python -m tools.gpu_check.ipc                 # CUDA: the Qwen2.5-3B weights under HF names, 512 MiB buckets
    python -m tools.gpu_check.ipc --cpu           # CPU: the tiny Qwen2's, over shared memory

A part of `tools.gpu_check.kit`, without SGLang: the consumer stands in for a colocated engine. The producer holds the
weights: random, bf16 on CUDA, in the HF layout transformers builds for the recipe's shape. It pushes them as the tensor
transport does (`slime_search.weight_sync`), in buckets of about `--update-weight-buffer-size` bytes
(`megatron_bridge.iter_buckets`). Each bucket is flattened into one tensor in SGLang's "flattened_bucket" layout. It is
serialized with ForkingPickler, whose torch reductions give a CUDA IPC handle, or shared memory on CPU. The consumer
copies it into weights of its own. The bucket is dropped once the consumer answered, then `release_ipc_memory` runs
(ipc_collect + empty_cache). Checked per bucket: the consumer read the producer's bytes (fingerprints), and on CUDA the
producer's reserved memory is back to its baseline; per push: the device's used memory (both processes) is the same as
after the first push. CPU mode runs the same code over torch's file_system shared memory; the device-memory checks are
CUDA only. SGLang's own reductions key the device by UUID (engines with another CUDA_VISIBLE_DEVICES); that part is
SGLang's.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler


def flatten_bucket(named: list) -> tuple:
    """A bucket's tensors as one uint8 tensor, end to end, and (name, shape, dtype, start, end) of each: the layout of
    SGLang's FlattenedTensorBucket, which the tensor transport sends as one handle per bucket."""
    import torch

    parts, metadata, start = [], [], 0
    for name, tensor in named:
        flat = tensor.reshape(-1).view(torch.uint8)
        parts.append(flat)
        metadata.append((name, tuple(tensor.shape), tensor.dtype, start, start + flat.numel()))
        start += flat.numel()
    return torch.cat(parts), metadata


def unflatten_bucket(flat, metadata) -> list:
    """The (name, tensor) views of a flattened bucket (SGLang's reconstruct_tensors)."""
    return [(name, flat[start:end].view(dtype).reshape(shape)) for name, shape, dtype, start, end in metadata]


def hf_layout(shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a push sends for a Qwen2 `shape`: transformers' own names on the meta device (no
    memory); a tied head is the embedding again and is not sent."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        tie_word_embeddings=shape.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return [
        (name, tuple(tensor.shape))
        for name, tensor in model.state_dict().items()
        if not (shape.tie_word_embeddings and name == "lm_head.weight")
    ]


def consume(requests, answers, cuda: bool) -> None:
    """The engine's side: map each bucket, copy it into weights of its own, answer, drop it."""
    import torch
    import torch.multiprocessing

    from tools.gpu_check.shared import fingerprint

    if not cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")
    weights = {}
    while (message := requests.get()) is not None:
        payload, metadata = message
        flat = pickle.loads(payload)
        for name, view in unflatten_bucket(flat, metadata):
            if name not in weights:  # the engine's own weights, allocated once
                weights[name] = torch.empty_like(view)
            weights[name].copy_(view)
        answer = {"fingerprint": fingerprint(flat)}
        del flat, view  # the engine closes its handle; the producer may free the bucket
        if cuda:
            torch.cuda.synchronize()
        answers.put(answer)
    answers.put({"weights": {name: fingerprint(tensor) for name, tensor in weights.items()}})


def device_used_gib() -> float | None:
    import torch

    from tools.gpu_check.shared import gib

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return gib(total - free)


def push(state: dict, bucket_bytes: int, requests, answers, baseline_reserved: int | None) -> dict:
    """Every bucket once: flattened, shared, answered, dropped, released; what stayed reserved after each."""
    import torch

    from megatron_bridge import iter_buckets
    from slime_search.weight_sync.rank import release_ipc_memory
    from tools.gpu_check.shared import fingerprint

    cuda = baseline_reserved is not None
    buckets, mismatched, largest, left = 0, [], 0, []
    started = time.perf_counter()
    for bucket in iter_buckets(state.items(), bucket_bytes):
        flat, metadata = flatten_bucket(bucket)
        largest = max(largest, flat.numel())
        sent = fingerprint(flat)
        requests.put((bytes(ForkingPickler.dumps(flat)), metadata))
        if answers.get(timeout=30)["fingerprint"] != sent:
            mismatched.append(buckets)
        del flat
        release_ipc_memory()
        if cuda:
            left.append(torch.cuda.memory_reserved() - baseline_reserved)
        buckets += 1
    return {
        "buckets": buckets,
        "largest_bucket_mib": round(largest / 2**20, 1),
        "seconds": round(time.perf_counter() - started, 3),
        "buckets_read_wrong": mismatched,
        "most_left_reserved_mib": round(max(left) / 2**20, 1) if left else None,
        "device_used_gib": device_used_gib(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=None, help="default: the recipe's (CPU: 64 KiB)")
    args = parser.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    from benchmarks.harness.recipe import CPU_MODEL, GPU_MODEL
    from tools.gpu_check.shared import emit, fingerprint, recipe_on_one_device

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    if not cuda:
        mp.set_sharing_strategy("file_system")  # as the tensor transport's CPU path: between any two processes
    recipe = recipe_on_one_device(GPU_MODEL if cuda else CPU_MODEL, cpu=not cuda)
    bucket_bytes = args.bucket_bytes or (recipe.bucket_bytes if cuda else 1 << 16)
    device = "cuda" if cuda else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = recipe.options.params_dtype
    state = {
        name: torch.randn(shape, generator=generator, device=device, dtype=dtype)
        for name, shape in hf_layout(recipe.shape)
    }
    context = mp.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    consumer = context.Process(target=consume, args=(requests, answers, cuda), daemon=True)
    consumer.start()
    baseline = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_reserved()  # the producer's weights, nothing in flight
    summary = {
        "part": "ipc",
        "transport": "CUDA IPC handles" if cuda else "shared memory (file_system)",
        "tensors": len(state),
        "state_gib": round(sum(t.numel() * t.element_size() for t in state.values()) / 2**30, 2),
        "bucket_bytes": bucket_bytes,
        "pushes": [],
    }
    try:
        for number in range(1, args.pushes + 1):
            result = push(state, bucket_bytes, requests, answers, baseline)
            emit({"part": "ipc", "push": number, **result})
            summary["pushes"].append(result)
        requests.put(None)
        copied = answers.get(timeout=30)["weights"]
        summary["consumer_weights_equal"] = copied == {name: fingerprint(t) for name, t in state.items()}
    finally:
        consumer.join(timeout=30)
        if consumer.is_alive():
            consumer.terminate()
    used = [p["device_used_gib"] for p in summary["pushes"]]
    summary["device_used_steady"] = None if used[0] is None else max(used) - min(used) <= 0.01
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
