"""The parallel layouts Megatron-core and SGLang accept, said at start-up with the flags' names.

Megatron-core 0.16 refuses sequence parallelism without tensor parallelism (ModelParallelConfig) and attention heads
that do not split over the tensor-parallel ranks (TransformerConfig); its linear layers divide their widths by the
tensor-parallel size. The HF <-> Megatron weight mapping gives each rank whole key/value heads and an equal share of
the MLP. So the actor's tensor-parallel size must divide both. Megatron itself would replicate key/value heads over
more ranks than there are heads; the mapping does not. SGLang's Qwen2/Qwen3 attention splits the query heads over an
engine's GPUs and takes key/value heads that are a multiple or a divisor of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Widths:
    """What tensor parallelism splits, and where it was read (for the messages)."""

    heads: int
    kv_heads: int
    ffn_hidden_size: int
    source: str  # "the model flags" or "config.json"


def widths_from_hf_config(config) -> Widths:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return Widths(heads, kv_heads, int(config.intermediate_size), "config.json")


def widths_from_flags(args) -> Widths | None:
    """The widths ${MODEL_ARGS[@]} gives (None without model flags)."""
    if getattr(args, "num_attention_heads", None) is None or getattr(args, "ffn_hidden_size", None) is None:
        return None
    grouped = args.group_query_attention and args.num_query_groups
    kv_heads = args.num_query_groups if grouped else args.num_attention_heads
    return Widths(args.num_attention_heads, kv_heads, args.ffn_hidden_size, "the model flags")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def actor_tp_sizes(widths: Widths, actor_ranks: int) -> list[int]:
    """The tensor-parallel sizes the actor can use: they divide the heads, the key/value heads, the MLP and the ranks."""
    return [
        d
        for d in _divisors(actor_ranks)
        if widths.heads % d == 0 and widths.kv_heads % d == 0 and widths.ffn_hidden_size % d == 0
    ]


def engine_tp_fits(widths: Widths, tp: int) -> bool:
    """SGLang's rule for one engine's GPUs: they split the query heads; key/value heads split or are replicated."""
    kv_ok = widths.kv_heads % tp == 0 if widths.kv_heads >= tp else tp % widths.kv_heads == 0
    return widths.heads % tp == 0 and kv_ok


def layout_errors(
    *,
    actor_ranks: int,
    tp: int,
    sequence_parallel: bool,
    engine_gpus: int = 0,
    engine_tp: int = 1,
    widths: Widths | None = None,
) -> list[str]:
    """Every rule of the layout that these flags break, one message each (flag, why, what to use instead); `widths`
    None: only the rules that do not depend on the model. `engine_gpus` 0: no SGLang engines (the CPU engine)."""
    errors = []
    if sequence_parallel and tp == 1:
        errors.append(
            "--sequence-parallel splits activations over the tensor-parallel ranks and Megatron refuses it without "
            "tensor parallelism: drop --sequence-parallel, or use --tensor-model-parallel-size 2 or more"
        )
    if actor_ranks % tp:
        errors.append(
            f"--tensor-model-parallel-size {tp} must divide the actor's {actor_ranks} ranks "
            "(--actor-num-nodes x --actor-num-gpus-per-node); the rest is data parallel"
        )
    if widths is not None:
        split = {
            "attention heads": widths.heads,
            "key/value heads": widths.kv_heads,
            "MLP hidden size": widths.ffn_hidden_size,
        }
        refused = [f"{count} {name}" for name, count in split.items() if count % tp]
        if refused:
            usable = ", ".join(map(str, actor_tp_sizes(widths, actor_ranks)))
            errors.append(
                f"--tensor-model-parallel-size {tp} must divide the model's {' and '.join(refused)} "
                f"({widths.source}): each rank holds an equal share of whole heads; use one of {usable}"
            )
        if engine_gpus and not engine_tp_fits(widths, engine_tp):
            usable = ", ".join(str(d) for d in _divisors(engine_gpus) if engine_tp_fits(widths, d))
            errors.append(
                f"--rollout-num-gpus-per-engine {engine_tp} (an SGLang engine's tensor-parallel size) must divide the "
                f"model's {widths.heads} attention heads, and its {widths.kv_heads} key/value heads must be a multiple "
                f"or a divisor of it ({widths.source}); SGLang refuses it at start: use one of {usable}"
            )
    return errors


def check_layout(args, widths: Widths | None) -> None:
    """The parsed flags' layout; ValueError listing every broken rule. `widths` None: the rules that do not depend on
    the model."""
    actor_ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    errors = layout_errors(
        actor_ranks=actor_ranks,
        tp=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        engine_gpus=actor_ranks if args.colocate else args.rollout_num_gpus,
        engine_tp=args.rollout_num_gpus_per_engine,
        widths=widths,
    )
    if errors:
        raise ValueError("\n  ".join(errors))
