"""The RMSNorm of the local layer spec, one that also runs under sequence parallelism.

Megatron's local spec builds its RMSNorms as WrappedTorchNorm (a torch.nn.RMSNorm), which refuses sequence
parallelism outright (megatron/core/transformer/torch_norm.py): without TransformerEngine or Apex, `--sequence-parallel`
could not build a model. torch's RMSNorm is correct on a part of the sequence as well, since it normalises each token
alone; what sequence parallelism adds is that each tensor-parallel rank then sees only its part of the tokens, so its
gradient of the weight (which every rank holds whole) is partial. Megatron's finalize_model_grads sums, across the
tensor-parallel group, the gradients of the weights marked `sequence_parallel`, as its own TENorm and FusedLayerNorm
mark theirs.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built with the arguments a Megatron spec passes to a norm (the same parameter, state dict and
    sharded state dict as WrappedTorchNorm's). `sequence_sharded`: whether its input is split along the sequence when
    the config has sequence parallelism. The layer norms and the final norm see sharded activations; the q/k norms act
    on attention heads after the sequence is gathered (their gradients, partial over each rank's heads, Megatron sums
    by name under qk_layernorm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, sequence_sharded: bool = True):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel and sequence_sharded)
