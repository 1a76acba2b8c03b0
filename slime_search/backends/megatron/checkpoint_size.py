"""The bytes of one actor checkpoint (`checkpoint.save_actor`), from the model's parameters and parallel layout.

A checkpoint holds the model once, each global tensor in the parameters' dtype (torch_dist keeps one replica). It holds
the optimizer state once per tensor-parallel slice. That is Adam's two fp32 moments of every parameter the slice holds,
and, when the parameters are bf16 or fp16, Megatron's fp32 main weights of them. A slice holds its share of the sharded
tensors and all of the replicated ones (the RMSNorm weights), so the slices add up to a little more than the model. The
RNG states, the rollout state and torch_dist's metadata are a few kilobytes.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4
ADAM_MOMENTS = 2


@dataclass(frozen=True)
class CheckpointLayout:
    model_parameters: int  # every global parameter once (the padded vocabulary included)
    # the parameters each tensor-parallel slice trains (the optimizer state's), replicated ones included
    slice_parameters: tuple[int, ...]
    param_bytes: int  # bytes of one parameter in the model's dtype (2 for bf16)

    @property
    def main_weights(self) -> bool:
        """Megatron's mixed-precision optimizer keeps an fp32 copy of bf16/fp16 parameters; fp32 ones step directly."""
        return self.param_bytes < FP32_BYTES

    def model_bytes(self) -> int:
        return self.model_parameters * self.param_bytes

    def optimizer_bytes(self) -> int:
        per_parameter = FP32_BYTES * (ADAM_MOMENTS + (1 if self.main_weights else 0))
        return sum(self.slice_parameters) * per_parameter


def checkpoint_bytes(layout: CheckpointLayout) -> int:
    """One checkpoint: the model in its dtype once, plus per tensor-parallel slice the fp32 main weights (bf16 and fp16
    models) and two Adam moments of the slice's parameters."""
    return layout.model_bytes() + layout.optimizer_bytes()


def rank_parameters(model) -> tuple[int, int]:
    """Counts of what this rank trains, which is what a checkpoint holds: every parameter, or under LoRA the adapters.
    The pair is (held, own). The first is what its optimizer state covers. The second is its share of the global model:
    a tensor replicated over the TP ranks counts on TP rank 0 only."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    trained = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in trained), sum(p.numel() for p in trained if param_is_not_tensor_parallel_duplicate(p))


def layout_of_ranks(per_rank: list[tuple[int, int, int]], param_bytes: int) -> CheckpointLayout:
    """The layout from each rank's (tensor-parallel rank, held, own) counts (`rank_parameters`), in rank order: the
    first data-parallel group's ranks are the slices, and the model is their own shares together."""
    slices: dict[int, tuple[int, int]] = {}
    for tp_rank, held, own in per_rank:
        slices.setdefault(tp_rank, (held, own))
    return CheckpointLayout(
        model_parameters=sum(own for _, own in slices.values()),
        slice_parameters=tuple(slices[tp][0] for tp in sorted(slices)),
        param_bytes=param_bytes,
    )


def layout_of_shape(shape, padded_vocab: int, tp_size: int, param_bytes: int) -> CheckpointLayout:
    """The layout a GPTModel of `shape` (a megatron_bridge ModelShape) has at `tp_size`, without building it.

    The attention and MLP matrices, the q/k/v bias and the (padded) embedding are split over the slices. The RMSNorm
    weights are replicated."""
    h, f, hd = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    qkv_out = (shape.num_heads + 2 * shape.num_kv_heads) * hd
    split_per_layer = h * qkv_out + (qkv_out if shape.qkv_bias else 0) + shape.num_heads * hd * h + 3 * h * f
    replicated_per_layer = 2 * h + (2 * hd if shape.qk_norm else 0)
    split = padded_vocab * h * (1 if shape.tie_word_embeddings else 2) + shape.num_layers * split_per_layer
    replicated = shape.num_layers * replicated_per_layer + h  # + the final norm
    if split % tp_size:
        raise ValueError(f"{split} split parameters do not divide over tensor-parallel size {tp_size}")
    return CheckpointLayout(
        model_parameters=split + replicated,
        slice_parameters=(split // tp_size + replicated,) * tp_size,
        param_bytes=param_bytes,
    )
