"""What an actor rank holds for training, computed from its built model.

It holds the weights and the gradients of what trains (Megatron's fp32 gradient buffers). It also holds the optimizer's
state: Adam's two fp32 moments, and an fp32 master copy of weights kept in another dtype. The distributed optimizer
splits that state over the data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1024**3
FP32 = 4


@dataclass(frozen=True)
class ActorMemory:
    parameters: int  # held on this rank
    trainable: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GIB:.2f} GiB: weights {self.weight_bytes / GIB:.2f}, gradients "
            f"{self.gradient_bytes / GIB:.2f}, optimizer state {self.optimizer_bytes / GIB:.2f}; "
            f"{self.trainable:,} of {self.parameters:,} parameters train"
        )


def actor_memory(model: torch.nn.Module, optimizer_shards: int = 1) -> ActorMemory:
    """`optimizer_shards`: the data-parallel ranks the distributed optimizer splits its state over (1 without it).
    Activations are not counted: they depend on --max-tokens-per-gpu and recomputation."""
    parameters = list(model.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    master = sum(p.numel() for p in trainable if p.dtype != torch.float32)  # an fp32 copy of each
    return ActorMemory(
        parameters=sum(p.numel() for p in parameters),
        trainable=count,
        weight_bytes=sum(p.numel() * p.element_size() for p in parameters),
        gradient_bytes=count * FP32,
        optimizer_bytes=(2 * count + master) * FP32 // optimizer_shards,
    )
