"""Qwen2 / Qwen2.5 and Qwen3 (dense) weights between Hugging Face names and Megatron-core GPTModel names.

Qwen3 differs from Qwen2 in three ways the mapping follows: no q/k/v bias; a per-head RMSNorm on queries and keys
(`self_attn.q_norm` / `k_norm`, [head_dim] each, applied before RoPE: Megatron's `q_layernorm` / `k_layernorm`
with qk_layernorm); and head_dim given in config.json rather than hidden_size / heads (Qwen3-4B: 2560 / 32 = 80,
head_dim 128; Megatron's kv_channels).

Layout facts the mapping encodes:
- Megatron's fused `linear_qkv` interleaves per query group: for each of the G groups, its H/G query heads,
  then its key head, then its value head (each head_dim rows); the qkv bias follows the same order.
- `linear_fc1` is cat(gate, up) along the output dimension (SwiGLU: silu(first half) * second half).
- Layer norms: local-spec names (`input_layernorm`, `pre_mlp_layernorm`) on CPU, or TransformerEngine's fused
  names (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) with the TE spec on GPU.
- Word embeddings (and an untied output layer) are padded with zero rows to a vocabulary divisible by
  `make_vocab_size_divisible_by * tp`; the padding is removed on the way back.
- Tensor parallelism: column-parallel weights (qkv by whole query groups, fc1 per half, embeddings and output
  layer by vocabulary rows) split on dim 0; row-parallel weights (`linear_proj`, `linear_fc2`) on dim 1; norms
  are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

FAMILIES = ("qwen2", "qwen3")  # config.json's model_type values the mapping knows


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2: biases on q/k/v; Qwen3: none
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on queries and keys
    kv_channels: int | None = None  # head_dim when it is not hidden_size / num_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_heads

    @property
    def family(self) -> str:
        return "qwen3" if self.qk_norm else "qwen2"

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        model_type = getattr(config, "model_type", "qwen2")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
        qwen3 = model_type == "qwen3"
        head_dim = getattr(config, "head_dim", None) if qwen3 else None
        default_head_dim = config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=bool(getattr(config, "attention_bias", False)) if qwen3 else True,
            qk_norm=qwen3,
            kv_channels=head_dim if head_dim and head_dim != default_head_dim else None,
        )


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _norm_names(i: int, te: bool) -> tuple[str, str]:
    if te:
        return (
            f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
            f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
        )
    return f"decoder.layers.{i}.input_layernorm.weight", f"decoder.layers.{i}.pre_mlp_layernorm.weight"


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < weight.shape[0]:
        raise ValueError(f"cannot pad {weight.shape[0]} vocabulary rows down to {rows}")
    return (
        torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
        if rows > weight.shape[0]
        else weight
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) -> Megatron's group-interleaved linear_qkv."""
    groups, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * hd, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)], dim=1
    )
    return fused.reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _qkv_kinds(shape: ModelShape) -> tuple[str, ...]:
    return ("weight", "bias") if shape.qkv_bias else ("weight",)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: ModelShape, padded_vocab: int, te_names: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron state dict from an HF Qwen2/Qwen3 state dict; raises naming any missing tensor."""

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(
                f"HF checkpoint lacks {name!r}: is it a {shape.family} model with {shape.num_layers} layers?"
            )
        return hf[name]

    out = {"embedding.word_embeddings.weight": _pad_rows(get("model.embed_tokens.weight"), padded_vocab)}
    for i in range(shape.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_names(i, te_names)
        out[attn_norm] = get(hp + "input_layernorm.weight")
        for kind in _qkv_kinds(shape):
            q, k, v = (get(f"{hp}self_attn.{p}_proj.{kind}") for p in "qkv")
            out[f"{mp}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, shape)
        if shape.qk_norm:
            out[mp + "self_attention.q_layernorm.weight"] = get(hp + "self_attn.q_norm.weight")
            out[mp + "self_attention.k_layernorm.weight"] = get(hp + "self_attn.k_norm.weight")
        out[mp + "self_attention.linear_proj.weight"] = get(hp + "self_attn.o_proj.weight")
        out[mlp_norm] = get(hp + "post_attention_layernorm.weight")
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [get(hp + "mlp.gate_proj.weight"), get(hp + "mlp.up_proj.weight")]
        )
        out[mp + "mlp.linear_fc2.weight"] = get(hp + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(get("lm_head.weight"), padded_vocab)
    return out


def _layer_to_hf(i: int, mg: dict[str, torch.Tensor], shape: ModelShape, te_names: bool) -> dict[str, torch.Tensor]:
    hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn_norm, mlp_norm = _norm_names(i, te_names)
    out = {hp + "input_layernorm.weight": mg[attn_norm]}
    for kind in _qkv_kinds(shape):
        q, k, v = split_qkv(mg[f"{mp}self_attention.linear_qkv.{kind}"], shape)
        out[f"{hp}self_attn.q_proj.{kind}"], out[f"{hp}self_attn.k_proj.{kind}"] = q, k
        out[f"{hp}self_attn.v_proj.{kind}"] = v
    if shape.qk_norm:
        out[hp + "self_attn.q_norm.weight"] = mg[mp + "self_attention.q_layernorm.weight"]
        out[hp + "self_attn.k_norm.weight"] = mg[mp + "self_attention.k_layernorm.weight"]
    out[hp + "self_attn.o_proj.weight"] = mg[mp + "self_attention.linear_proj.weight"]
    out[hp + "post_attention_layernorm.weight"] = mg[mlp_norm]
    gate, up = torch.chunk(mg[mp + "mlp.linear_fc1.weight"], 2, dim=0)
    out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
    out[hp + "mlp.down_proj.weight"] = mg[mp + "mlp.linear_fc2.weight"]
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def megatron_conversion_units(names: Iterable[str]) -> list[list[str]]:
    """Megatron names grouped into the units megatron_to_hf_part converts on their own, in HF order: the
    embedding, each decoder layer, then the final norm and the output layer. Streaming conversion gathers and
    converts one unit at a time instead of the whole model."""
    head, layers, tail = [], {}, []
    for name in names:
        match = _LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
        elif name.startswith("embedding."):
            head.append(name)
        else:
            tail.append(name)
    units = [head] + [layers[i] for i in sorted(layers)] + [tail]
    return [unit for unit in units if unit]


def megatron_to_hf_part(mg: dict[str, torch.Tensor], shape: ModelShape, te_names: bool = False) -> dict:
    """HF tensors of the whole units (see megatron_conversion_units) present in `mg`, vocabulary padding removed.
    A tied `lm_head.weight` is left out: it is the embedding, and engines tie it themselves."""
    vocab = shape.vocab_size
    out = {}
    if "embedding.word_embeddings.weight" in mg:
        out["model.embed_tokens.weight"] = mg["embedding.word_embeddings.weight"][:vocab]
    for i in sorted({int(m.group(1)) for m in map(_LAYER.match, mg) if m}):
        out.update(_layer_to_hf(i, mg, shape, te_names))
    if "decoder.final_layernorm.weight" in mg:
        out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if "output_layer.weight" in mg and not shape.tie_word_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:vocab]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: ModelShape, te_names: bool = False) -> dict[str, torch.Tensor]:
    """HF state dict (vocab padding removed) from a full Megatron state dict."""
    out = megatron_to_hf_part(mg, shape, te_names)
    if shape.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _parallel_kind(name: str) -> str:
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def shard_tensor_parallel(mg: dict[str, torch.Tensor], shape: ModelShape, tp_size: int, tp_rank: int) -> dict:
    """The slice of a full Megatron state dict that TP rank `tp_rank` of `tp_size` holds."""
    if shape.num_kv_heads % tp_size or shape.num_heads % tp_size or shape.ffn_hidden_size % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} must divide the {shape.num_kv_heads} key/value heads, "
            f"{shape.num_heads} heads and the FFN size {shape.ffn_hidden_size}"
        )
    out = {}
    for name, tensor in mg.items():
        kind = _parallel_kind(name)
        if kind in ("qkv", "column"):  # qkv rows are whole query groups, in order: an even split keeps groups whole
            out[name] = torch.chunk(tensor, tp_size, dim=0)[tp_rank].clone()
        elif kind == "fc1":
            gate, up = torch.chunk(tensor, 2, dim=0)
            out[name] = torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]]).clone()
        elif kind == "row":
            out[name] = torch.chunk(tensor, tp_size, dim=1)[tp_rank].clone()
        else:
            out[name] = tensor.clone()
    return out


def gather_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of shard_tensor_parallel: the full state dict from every rank's slice, in rank order."""
    out = {}
    for name in shards[0]:
        parts = [shard[name] for shard in shards]
        kind = _parallel_kind(name)
        if kind in ("qkv", "column"):
            out[name] = torch.cat(parts, dim=0)
        elif kind == "fc1":
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        elif kind == "row":
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = parts[0]
    return out


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs grouped so that a bucket stays under `max_bytes` (a larger tensor goes
    alone). Lazy: a streaming source is drawn only as far as the bucket being filled."""
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    filled = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and filled + size > max_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += size
    if bucket:
        yield bucket
