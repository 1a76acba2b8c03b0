"""Megatron model flags with slime's names (as in scripts/models/*.sh), and their check against an HF config."""

from __future__ import annotations

import argparse

from megatron_bridge import ModelShape
from slime_search.backends.megatron.model import ModelOptions
from slime_search.config.model import SHAPE, ModelArgs
from slime_search.utils.flag_fields import add_flags


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> argparse.ArgumentParser:
    """`required=False` (training): the flags are optional; when given they are checked against config.json, and
    --make-vocab-size-divisible-by / --max-position-embeddings shape the model (left out: Megatron's 128 and
    config.json's context length). `required=True` (the converters): the shape must be given."""
    group = parser.add_argument_group("model (Megatron flags, see scripts/models/)")
    add_flags(group, ModelArgs, required=SHAPE if required else ())
    return parser


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, ModelOptions]:
    """The Qwen2 or Qwen3 shape and options the flags describe (--qk-layernorm: Qwen3); flags outside both families
    raise with the fix."""
    qwen3 = bool(getattr(args, "qk_layernorm", False))
    problems = []
    if not args.swiglu:
        problems.append("--swiglu (Qwen2 and Qwen3 use SwiGLU)")
    if not args.disable_bias_linear:
        problems.append("--disable-bias-linear (no biases outside q/k/v)")
    if qwen3 and args.add_qkv_bias:
        problems.append("no --add-qkv-bias with --qk-layernorm (Qwen3 has no q/k/v biases)")
    if not qwen3 and not args.add_qkv_bias:
        problems.append("--add-qkv-bias (Qwen2 has biases on q/k/v), or --qk-layernorm for Qwen3")
    if args.normalization != "RMSNorm":
        problems.append("--normalization RMSNorm")
    if not args.use_rotary_position_embeddings:
        problems.append("--use-rotary-position-embeddings")
    if problems:
        family = "Qwen3" if qwen3 else "Qwen2"
        raise ValueError(f"these model flags are needed for a {family} model: " + "; ".join(problems))
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else args.num_attention_heads
    shape = ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_attention_heads,
        num_kv_heads=groups,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.vocab_size,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        qkv_bias=not qwen3,
        qk_norm=qwen3,
        kv_channels=_kv_channels(args),
    )
    given = {"rotary_base": args.rotary_base, "rms_norm_eps": args.norm_epsilon}
    for name in ("make_vocab_size_divisible_by", "max_position_embeddings"):
        if getattr(args, name) is not None:  # left out in training: ModelOptions' defaults
            given[name] = getattr(args, name)
    return shape, ModelOptions(**given)


def _kv_channels(args: argparse.Namespace) -> int | None:
    """--kv-channels when it differs from hidden / heads (the default head size is left implicit, as
    ModelShape.from_hf_config leaves it)."""
    given = getattr(args, "kv_channels", None)
    return given if given is not None and given != args.hidden_size // args.num_attention_heads else None


def check_against_hf_config(shape: ModelShape, options: ModelOptions, hf_config) -> None:
    """Raise listing every model flag that disagrees with the HF checkpoint's config.json."""
    hf_shape, hf_options = ModelShape.from_hf_config(hf_config), ModelOptions.from_hf_config(hf_config)
    flag_of = {
        "num_layers": "--num-layers",
        "hidden_size": "--hidden-size",
        "num_heads": "--num-attention-heads",
        "num_kv_heads": "--num-query-groups",
        "ffn_hidden_size": "--ffn-hidden-size",
        "vocab_size": "--vocab-size",
        "tie_word_embeddings": "--untie-embeddings-and-output-weights (absent = tied)",
        "qk_norm": "--qk-layernorm (Qwen3)",
        "qkv_bias": "--add-qkv-bias (Qwen2)",
        "head_dim": "--kv-channels",
    }
    wrong = [
        f"{flag_of[field]}: flags say {getattr(shape, field)}, config.json says {getattr(hf_shape, field)}"
        for field in flag_of
        if getattr(shape, field) != getattr(hf_shape, field)
    ]
    if abs(options.rotary_base - hf_options.rotary_base) > 1e-6 * hf_options.rotary_base:
        wrong.append(f"--rotary-base: flags say {options.rotary_base:g}, config.json says {hf_options.rotary_base:g}")
    if abs(options.rms_norm_eps - hf_options.rms_norm_eps) > 1e-12:
        wrong.append(
            f"--norm-epsilon: flags say {options.rms_norm_eps:g}, config.json says {hf_options.rms_norm_eps:g}"
        )
    if wrong:
        raise ValueError("model flags do not match the HF checkpoint:\n  " + "\n  ".join(wrong))
