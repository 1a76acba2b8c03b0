"""Parameter count of a Qwen2-family GPTModel from its shape, without allocating any weight."""

from __future__ import annotations

from megatron_bridge.qwen2 import Qwen2Shape


def count_parameters(shape: Qwen2Shape, padded_vocab: int | None = None) -> int:
    h, f, hd = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    vocab = padded_vocab if padded_vocab is not None else shape.vocab_size
    qkv_out = (shape.num_heads + 2 * shape.num_kv_heads) * hd
    per_layer = (
        h * qkv_out
        + qkv_out  # linear_qkv weight and bias
        + shape.num_heads * hd * h  # linear_proj
        + h * 2 * f  # linear_fc1 (gate and up)
        + f * h  # linear_fc2
        + 2 * h  # two RMSNorm weights
    )
    embeddings = vocab * h * (1 if shape.tie_word_embeddings else 2)
    return embeddings + shape.num_layers * per_layer + h  # + final norm
