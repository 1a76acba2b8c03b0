"""Time a LoRA run's weight push into a running SGLang engine both ways: adapters folded in, or adapters alone.
The first way pushes the weights with the adapters folded in (the `tensor` transport's /update_weights_from_tensor, in
SGLang's weight-update session). The second pushes the adapters alone (--lora-sync-from-tensor). It uses
/load_lora_adapter_from_tensors under PEFT's names and replaces the served adapter.

    python -m benchmarks.perf.lora_push --engine-url http://127.0.0.1:PORT --model HF_FOLDER [--rank 32] [--repeats 3]

The engine must serve `--model` with LoRA on (`--enable-lora --max-lora-rank R --lora-target-modules all`) on this
machine: both ways hand it tensors in this process's host shared memory. The trainer side is this process holding
the HF-named state (the actor's gather and name conversion are not timed). The folded weights are `--model`'s own,
so each folded push leaves the engine as it was; the adapters are random, of rank `--rank` on every projection. Each
push is checked: the engine must report its version. Prints bytes and seconds per push (median of --repeats).

Its figures: `docs/benchmarks/lora.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch


def folded_state(model: Path) -> dict[str, torch.Tensor]:
    """What a folded push carries: the HF model's tensors (a tied head is pushed as the embedding)."""
    from megatron_bridge.hf_io import read_hf_state

    return {name: t for name, t in read_hf_state(str(model)).items() if name != "lm_head.weight"}


def random_adapters(model: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank-`rank` adapters on every projection of `model` under PEFT's names, and their adapter_config.json."""
    from transformers import AutoConfig

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.lora_peft import peft_adapter_config, peft_adapter_state
    from slime_search.config.lora import LoraConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model))
    gen = torch.Generator().manual_seed(0)
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    sizes = {  # Megatron's module: (in, out)
        "self_attention.linear_qkv": (shape.hidden_size, qkv),
        "self_attention.linear_proj": (shape.num_heads * shape.head_dim, shape.hidden_size),
        "mlp.linear_fc1": (shape.hidden_size, 2 * shape.ffn_hidden_size),
        "mlp.linear_fc2": (shape.ffn_hidden_size, shape.hidden_size),
    }
    adapters = {
        f"decoder.layers.{i}.{name}": (
            torch.randn(rank, n_in, generator=gen) * 0.01,
            torch.randn(n_out, rank, generator=gen) * 0.01,
        )
        for i in range(shape.num_layers)
        for name, (n_in, n_out) in sizes.items()
    }
    config = LoraConfig(lora_rank=rank)
    return peft_adapter_state(adapters, shape), peft_adapter_config(config, str(model))


def push_folded(url: str, state: dict, bucket_bytes: int, version: str) -> None:
    from megatron_bridge import iter_buckets
    from slime_search.engines.weight_wire import serialize_named_tensors
    from slime_search.weight_sync.broadcast import with_last
    from slime_search.weight_sync.tensor_handles import post_bucket
    from slime_search.weight_sync.transport_base import weight_update_session

    with weight_update_session([url]):
        for bucket, last in with_last(iter_buckets(state.items(), bucket_bytes)):
            asyncio.run(post_bucket(url, [serialize_named_tensors(bucket)], version if last else None))


def push_adapters(url: str, adapters: dict, adapter_config: dict, version: str, holds_it: bool) -> None:
    from slime_search.engines.weight_wire import serialize_named_tensors
    from slime_search.weight_sync.lora_adapters import replace_adapter

    entries = [serialize_named_tensors(adapters)]
    asyncio.run(replace_adapter(url, "bench-policy", entries, adapter_config, version, holds_it))


def timed(url: str, push, repeats: int, prefix: str) -> list[float]:
    from slime_search.weight_sync.transport_base import served_versions

    times = []
    for r in range(repeats):
        version = f"{prefix}{r}"
        started = time.perf_counter()
        push(version, r)
        times.append(time.perf_counter() - started)
        served = asyncio.run(served_versions([url]))
        if served != [version]:
            raise RuntimeError(f"engine serves {served} after the push of {version}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--model", type=Path, required=True, help="the HF folder the engine serves")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args(argv)

    state = folded_state(args.model)
    adapters, adapter_config = random_adapters(args.model, args.rank)
    sizes = {
        "folded weights (tensor)": sum(t.numel() * t.element_size() for t in state.values()),
        f"adapters alone, rank {args.rank}": sum(t.numel() * t.element_size() for t in adapters.values()),
    }
    url, bucket = args.engine_url, args.bucket_mb * 1024**2
    results = {
        "folded weights (tensor)": timed(url, lambda v, r: push_folded(url, state, bucket, v), args.repeats, "f"),
        f"adapters alone, rank {args.rank}": timed(
            url, lambda v, r: push_adapters(url, adapters, adapter_config, v, r > 0), args.repeats, "a"
        ),
    }
    print(f"{'push':<28} {'MB':>10} {'s / push (median)':>18}   all pushes (s)")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<28} {sizes[name] / 1e6:>10.3f} {median:>18.3f}   {', '.join(f'{t:.3f}' for t in times)}")
    print(json.dumps({name: {"bytes": sizes[name], "median_s": statistics.median(t)} for name, t in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
