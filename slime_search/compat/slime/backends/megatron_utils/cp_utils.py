"""slime.backends.megatron_utils.cp_utils at context-parallel size 1: the helpers slime's TIS/MIS helper (mis.py)
and loss use. This project's trainer has no context parallelism, so at size 1 a rank holds every response token:
gathering and slicing return what they are given. A context-parallel group larger than 1 is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def context_parallel_size() -> int:
    """Megatron's context-parallel world size once its groups exist; 1 before (a process that has not imported
    Megatron has none: it is not imported here for that)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def require_no_context_parallelism() -> None:
    size = context_parallel_size()
    if size != 1:
        raise NotImplementedError(
            f"slime's context-parallel helpers are served here at context-parallel size 1 only, got {size}"
        )


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """The whole response's values (its first dimension is `response_length`) from this rank's share of them."""
    require_no_context_parallelism()
    return tensor


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor,
    total_length: int,
    response_length: int,
    qkv_format: str = "thd",
    max_token_len: int | None = None,
) -> list[float] | torch.Tensor:
    """This rank's share of a response's per-token values."""
    if len(log_prob) != response_length:
        raise ValueError(f"{len(log_prob)} values for a response of {response_length} tokens")
    require_no_context_parallelism()
    return log_prob


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    calculate_per_token_loss: bool = False,
    qkv_format: str = "thd",
    max_seq_lens: list[int] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer of a flat per-token tensor: the sum over samples of each one's masked mean (or, per token, the
    masked sum), a sample's mean dividing by at least 1."""
    require_no_context_parallelism()

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        parts = zip(x.split(response_lengths, dim=0), loss_masks, strict=True)
        return sum((part * mask).sum() / torch.clamp_min(mask.sum(), 1) for part, mask in parts)

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum((part * mask).sum() for part, mask in zip(x.split(response_lengths, dim=0), loss_masks, strict=True))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean
