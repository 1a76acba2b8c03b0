"""Hugging Face <-> Megatron-core weight mapping for Qwen2 / Qwen2.5 and Qwen3 (dense), with tensor-parallel sharding."""

from megatron_bridge.qwen import (
    ModelShape,
    gather_tensor_parallel,
    hf_to_megatron,
    iter_buckets,
    megatron_conversion_units,
    megatron_to_hf,
    megatron_to_hf_part,
    pad_vocab_size,
    shard_tensor_parallel,
)

__all__ = [
    "ModelShape",
    "gather_tensor_parallel",
    "hf_to_megatron",
    "iter_buckets",
    "megatron_conversion_units",
    "megatron_to_hf",
    "megatron_to_hf_part",
    "pad_vocab_size",
    "shard_tensor_parallel",
]
