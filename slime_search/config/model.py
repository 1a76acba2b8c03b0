"""The model's shape as Megatron's flags give it (slime's scripts/models/*.sh), declared as the fields of
`ModelArgs`. Training takes them optionally (given, they are checked against config.json); the checkpoint converters
require the shape (`SHAPE`). backends.megatron.model_args turns them into the model's shape and options."""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import positive_float, positive_int

SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelArgs:
    num_layers: int | None = flag(None, "transformer layers", type=positive_int, slime=True)
    hidden_size: int | None = flag(None, "hidden size", type=positive_int, slime=True)
    ffn_hidden_size: int | None = flag(None, "MLP intermediate size", type=positive_int, slime=True)
    num_attention_heads: int | None = flag(None, "query heads", type=positive_int, slime=True)
    group_query_attention: bool = flag(False, "grouped-query attention (--num-query-groups)", slime=True)
    num_query_groups: int | None = flag(
        None, "key/value heads with --group-query-attention", type=positive_int, slime=True
    )
    vocab_size: int | None = flag(None, "the tokenizer's vocabulary (before padding)", type=positive_int, slime=True)
    untie_embeddings_and_output_weights: bool = flag(
        False, "an output layer of its own instead of the input embedding's weights (absent: tied)", slime=True
    )
    swiglu: bool = flag(False, "SwiGLU MLP (Qwen2 needs it)", slime=True)
    use_rotary_position_embeddings: bool = flag(False, "RoPE (Qwen2 needs it)", slime=True)
    disable_bias_linear: bool = flag(False, "no linear biases (Qwen2 needs it)", slime=True)
    add_qkv_bias: bool = flag(False, "biases on q/k/v (Qwen2 needs it; Qwen3 has none)", slime=True)
    qk_layernorm: bool = flag(False, "a per-head RMSNorm on queries and keys (Qwen3 needs it)", slime=True)
    kv_channels: int | None = flag(
        None,
        "the attention head size when it is not --hidden-size / --num-attention-heads (Qwen3: 128)",
        type=positive_int,
        slime=True,
    )
    normalization: str = flag("RMSNorm", "RMSNorm (Qwen2 needs it)", slime=True)
    norm_epsilon: float = flag(1e-6, "RMSNorm epsilon", type=positive_float, slime=True)
    rotary_base: float = flag(1_000_000.0, "RoPE base (rope_theta)", type=positive_float, slime=True)
    # left out: config.json's context length (training), Megatron's 32768 (the converters)
    max_position_embeddings: int | None = flag(
        None, "longest sequence the model is built for", type=positive_int, slime=True
    )
    # left out: Megatron's 128
    make_vocab_size_divisible_by: int | None = flag(
        None,
        "the embedding and output layer are padded to a multiple of this (x TP size), as Megatron pads them; give "
        "training the value the torch_dist checkpoint was converted with",
        type=positive_int,
        slime=True,
    )
