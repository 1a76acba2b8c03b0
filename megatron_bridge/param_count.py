"""Parameter count of a Qwen2/Qwen3 GPTModel from its shape, without allocating any weight."""

from __future__ import annotations

from megatron_bridge.qwen import ModelShape


def count_parameters(shape: ModelShape, padded_vocab: int | None = None) -> int:
    h, f, hd = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    vocab = padded_vocab if padded_vocab is not None else shape.vocab_size
    qkv_out = (shape.num_heads + 2 * shape.num_kv_heads) * hd
    per_layer = (
        h * qkv_out  # linear_qkv weight
        + (qkv_out if shape.qkv_bias else 0)  # its bias (Qwen2)
        + (2 * hd if shape.qk_norm else 0)  # q/k RMSNorm weights (Qwen3)
        + shape.num_heads * hd * h  # linear_proj
        + h * 2 * f  # linear_fc1 (gate and up)
        + f * h  # linear_fc2
        + 2 * h  # two RMSNorm weights
    )
    embeddings = vocab * h * (1 if shape.tie_word_embeddings else 2)
    return embeddings + shape.num_layers * per_layer + h  # + final norm
