"""Megatron model flags with slime's names (as in scripts/models/*.sh), and their check against an HF config."""

from __future__ import annotations

import argparse

from megatron_bridge import Qwen2Shape
from slime_search.backends.megatron.model import ModelOptions


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> argparse.ArgumentParser:
    """`required=False` (training): the flags are optional, and when given they are checked against config.json."""
    group = parser.add_argument_group("model (Megatron flags, see scripts/models/)")
    group.add_argument("--num-layers", type=int, required=required)
    group.add_argument("--hidden-size", type=int, required=required)
    group.add_argument("--ffn-hidden-size", type=int, required=required)
    group.add_argument("--num-attention-heads", type=int, required=required)
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=None)
    group.add_argument("--vocab-size", type=int, required=required)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--use-rotary-position-embeddings", action="store_true")
    group.add_argument("--disable-bias-linear", action="store_true")
    group.add_argument("--add-qkv-bias", action="store_true")
    group.add_argument("--normalization", default="RMSNorm")
    group.add_argument("--norm-epsilon", type=float, default=1e-6)
    group.add_argument("--rotary-base", type=float, default=1_000_000.0)
    group.add_argument("--max-position-embeddings", type=int, default=32768)
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return parser


def model_from_args(args: argparse.Namespace) -> tuple[Qwen2Shape, ModelOptions]:
    """The Qwen2 shape and options the flags describe; flags outside the Qwen2 family raise with the fix."""
    problems = []
    if not args.swiglu:
        problems.append("--swiglu (Qwen2 uses SwiGLU)")
    if not args.disable_bias_linear or not args.add_qkv_bias:
        problems.append("--disable-bias-linear --add-qkv-bias (Qwen2 has biases on q/k/v only)")
    if args.normalization != "RMSNorm":
        problems.append("--normalization RMSNorm")
    if not args.use_rotary_position_embeddings:
        problems.append("--use-rotary-position-embeddings")
    if problems:
        raise ValueError("these model flags are needed for a Qwen2-family model: " + "; ".join(problems))
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else args.num_attention_heads
    shape = Qwen2Shape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_attention_heads,
        num_kv_heads=groups,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.vocab_size,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
    )
    options = ModelOptions(
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        rotary_base=args.rotary_base,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.norm_epsilon,
    )
    return shape, options


def check_against_hf_config(shape: Qwen2Shape, options: ModelOptions, hf_config) -> None:
    """Raise listing every model flag that disagrees with the HF checkpoint's config.json."""
    hf_shape, hf_options = Qwen2Shape.from_hf_config(hf_config), ModelOptions.from_hf_config(hf_config)
    flag_of = {
        "num_layers": "--num-layers",
        "hidden_size": "--hidden-size",
        "num_heads": "--num-attention-heads",
        "num_kv_heads": "--num-query-groups",
        "ffn_hidden_size": "--ffn-hidden-size",
        "vocab_size": "--vocab-size",
        "tie_word_embeddings": "--untie-embeddings-and-output-weights (absent = tied)",
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
