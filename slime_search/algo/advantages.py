"""GRPO outcome advantages, grouped by an explicit group id.

Grouping by id (not by reshaping the batch to [n_groups, n_samples]) stays correct when groups have unequal
sizes, e.g. after failed samples were dropped or zero-variance groups were filtered; a reshape-based version
silently falls back to whole-batch statistics in that case.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g when normalize_std is False (Dr.GRPO).

    std_g is the unbiased standard deviation of the group (torch.std's default, as GRPO implementations use).
    A group with a single member has no baseline to compare against and gets advantage 0.
    """
    # float64 inside: a zero-variance group must give exactly-zero-ish advantages, and float32 round-off in the
    # group mean divided by (0 + eps) would otherwise turn into advantages of order 1e-2.
    rewards = torch.as_tensor(rewards).to(torch.float64)
    group_ids = torch.as_tensor(group_ids)
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    if rewards.numel() == 0:
        return rewards.to(torch.float32)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, torch.ones_like(rewards))
    means = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, rewards) / counts
    centred = rewards - means[inverse]
    singleton = counts[inverse] < 2
    if normalize_std:
        sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add(0, inverse, centred**2)
        std = torch.sqrt(sq / (counts - 1).clamp_min(1))
        centred = centred / (std[inverse] + eps)
    return torch.where(singleton, torch.zeros_like(centred), centred).to(torch.float32)


def expand_to_tokens(values: torch.Tensor, lengths: torch.Tensor | list[int]) -> torch.Tensor:
    """Broadcast one value per sequence to every token of that packed sequence."""
    total = int(sum(lengths)) if isinstance(lengths, (list, tuple)) else int(lengths.sum())
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=values.device)
    if values.shape != lengths.shape:
        raise ValueError(f"{values.numel()} values for {lengths.numel()} sequences")
    # the output size is known on the host: no device round trip to learn it
    return torch.repeat_interleave(values, lengths, output_size=total)
