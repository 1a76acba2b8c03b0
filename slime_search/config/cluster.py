"""Where the actor runs and how it is laid out, and how its weights reach the engines: command-line flags declared as
the fields of `ClusterConfig` (slime's and Megatron's names). Megatron's recomputation rules are checked when it is
built."""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import positive_int

# The weight transports' names; weight_sync.transports registers one kind under each (and checks that it does).
TRANSPORT_NAMES = ("disk", "nccl", "tensor")
ATTENTION_IMPLS = ("auto", "te", "local", "packed")


@dataclass(frozen=True)
class ClusterConfig:
    actor_num_nodes: int = flag(1, "nodes of the Megatron actor", type=positive_int, slime=True)
    actor_num_gpus_per_node: int = flag(1, "Megatron ranks per node (CPU: processes)", type=positive_int, slime=True)
    tensor_model_parallel_size: int = flag(
        1,
        "Megatron tensor-parallel size; must divide the actor's ranks (the rest is data parallel)",
        type=positive_int,
        slime=True,
    )
    sequence_parallel: bool = flag(False, "Megatron sequence parallelism (with tensor parallelism)", slime=True)
    bf16: bool = flag(False, "bf16 parameters (GPU); fp32 otherwise", slime=True)
    attention_impl: str = flag(
        "auto",
        "the actor's attention: 'te' TransformerEngine's layer spec; 'packed' Megatron's local spec attending within "
        "each packed sample through torch's SDPA (memory linear in the packed length); 'local' Megatron's local "
        "attention, which scores a packed row whole (quadratic); 'auto': te where TransformerEngine is installed and "
        "CUDA present, else packed",
        choices=ATTENTION_IMPLS,
    )
    recompute_granularity: str | None = flag(
        None,
        "Megatron activation recomputation: full layers (with --recompute-method and --recompute-num-layers) or "
        "selective (the core attention, whose scores the local attention without TransformerEngine keeps whole)",
        choices=("full", "selective"),
        slime=True,
    )
    recompute_method: str | None = flag(None, "with full recompute", choices=("uniform", "block"), slime=True)
    recompute_num_layers: int | None = flag(
        None, "layers per recompute unit (full recompute)", type=positive_int, slime=True
    )
    colocate: bool = flag(
        False,
        "engines on the actor's GPUs: the actor offloads to host memory while they generate, they release theirs "
        "while it trains (SGLang's memory saver); weights go by tensor handles",
        slime=True,
    )
    update_weight_transport: str | None = flag(
        None,
        "weight sync after each step: 'nccl' broadcasts from actor rank 0 to the engines (NCCL on GPU, gloo on CPU); "
        "'tensor' gives engines on the actor's devices handles to the actor's tensors (CUDA IPC on GPU, shared "
        "memory on CPU); 'disk' writes an HF checkpoint the engines load. Default: tensor with --colocate, nccl with "
        "engines on GPUs of their own, disk otherwise",
        choices=TRANSPORT_NAMES,
        slime=True,
    )
    update_weight_buffer_size: int = flag(512 * 1024**2, "bytes per weight-sync bucket", type=positive_int, slime=True)

    def __post_init__(self) -> None:
        """Megatron's rules for activation recomputation, said at start-up with the flags' names."""
        granularity, method, layers = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity != "full" and (method or layers):
            raise ValueError("--recompute-method and --recompute-num-layers go with --recompute-granularity full only")
        if granularity == "full" and (method is None or layers is None):
            raise ValueError("--recompute-granularity full needs --recompute-method and --recompute-num-layers")

    @property
    def actor_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node
