"""The optimizer's configuration, each field declared once as its command-line flag (Megatron's names, which slime
passes through): the parser and the config are both built from these fields (`slime_search.utils.flag_fields`)."""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import below_one, non_negative_float, non_negative_int, positive_int

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = flag(
        "adam",
        "adam, the only optimizer (Adam with decoupled weight decay, as Megatron's); accepted so that slime commands "
        "parse",
        choices=["adam"],
        slime=True,
    )
    lr: float = flag(1e-6, "peak learning rate", type=non_negative_float, slime=True)
    min_lr: float = flag(0.0, "learning rate at the end of the decay", type=non_negative_float, slime=True)
    lr_warmup_iters: int = flag(0, "optimizer steps of linear warm-up to --lr", type=non_negative_int, slime=True)
    lr_decay_iters: int | None = flag(
        None,
        "optimizer steps (not rollouts; warm-up included) after which the decay reaches --min-lr; default: the whole "
        "run, --num-rollout x the optimizer steps of a rollout (1, or its samples / --global-batch-size)",
        type=positive_int,
        slime=True,
    )
    lr_decay_style: str = flag(
        "constant",
        "after the warm-up: constant, or a linear / cosine decay to --min-lr that ends at --lr-decay-iters",
        choices=LR_DECAY_STYLES,
        slime=True,
    )
    weight_decay: float = flag(0.0, "Adam's decoupled weight decay", type=non_negative_float, slime=True)
    adam_beta1: float = flag(0.9, "Adam's beta1, in [0, 1)", type=below_one, slime=True)
    adam_beta2: float = flag(0.98, "Adam's beta2, in [0, 1)", type=below_one, slime=True)
    adam_eps: float = 1e-8
    clip_grad: float = flag(
        1.0, "clip the global gradient norm to this (0: no clipping)", type=non_negative_float, slime=True
    )
    use_distributed_optimizer: bool = False  # set by the layout (GPU, data-parallel), not a flag here

    def __post_init__(self):
        """The converters' rules, for a config built in code as well as from the command line."""
        problems = [
            f"{name} must be >= 0, got {getattr(self, name)}"
            for name in ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad")
            if getattr(self, name) < 0
        ]
        problems += [
            f"{name} must be in [0, 1), got {getattr(self, name)}"
            for name in ("adam_beta1", "adam_beta2")
            if not 0 <= getattr(self, name) < 1
        ]
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            problems.append(f"lr_decay_iters must be >= 1 or None, got {self.lr_decay_iters}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            problems.append(f"lr_decay_style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.adam_eps <= 0:
            problems.append(f"adam_eps must be > 0, got {self.adam_eps}")
        if problems:
            raise ValueError("OptimConfig: " + "; ".join(problems))
