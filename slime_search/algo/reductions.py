"""Masked reductions over packed token tensors.

Two loss aggregations are offered, both correct under gradient accumulation when the caller passes the
*global* denominator (tokens or sequences in the whole step), so that summing micro-batch losses gives
exactly the full-batch loss:

- token_mean:    sum_i sum_t m_it x_it / N_tokens            (every valid token weighs the same)
- sequence_mean: sum_i (sum_t m_it x_it / sum_t m_it) / N_seq (slime's default: each sequence weighs the same)
"""

from __future__ import annotations

import torch


def segment_ids(lengths: torch.Tensor | list[int], device: torch.device | None = None) -> torch.Tensor:
    """[2, 3] -> [0, 0, 1, 1, 1]: the sequence each packed token belongs to."""
    if isinstance(lengths, (list, tuple)):
        if any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 0, got {list(lengths)}")
        total = sum(lengths)
    else:
        if (lengths < 0).any():
            raise ValueError(f"sequence lengths must be >= 0, got {lengths.tolist()}")
        total = int(lengths.sum())
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    # the output size is known on the host: no device round trip to learn it (and meta tensors need it)
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)


def _check_packed(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | list[int] | None = None) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"values {tuple(x.shape)} and mask {tuple(mask.shape)} differ in shape")
    if lengths is not None and int(torch.as_tensor(lengths).sum()) != x.numel():
        raise ValueError(f"lengths sum to {int(torch.as_tensor(lengths).sum())} but {x.numel()} tokens are packed")


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _check_packed(x, mask)
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1; 0 when the mask is empty."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def per_sequence_sums(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | list[int]) -> torch.Tensor:
    _check_packed(x, mask, lengths)
    seg = segment_ids(lengths, device=x.device)
    out = torch.zeros(len(torch.as_tensor(lengths)), dtype=x.dtype, device=x.device)
    return out.index_add(0, seg, x * mask)


def per_sequence_means(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | list[int]) -> torch.Tensor:
    """Masked mean within each sequence; a sequence with no valid token gets 0."""
    sums = per_sequence_sums(x, mask, lengths)
    counts = per_sequence_sums(torch.ones_like(mask, dtype=x.dtype), mask.to(x.dtype), lengths)
    return sums / counts.clamp_min(1)


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum(m * x) / num_tokens; num_tokens defaults to sum(m) of this batch (pass the global count when accumulating)."""
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=x.dtype, device=x.device)
    return masked_sum(x, mask) / torch.clamp_min(denom, 1)


def sequence_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor | list[int],
    num_sequences: int | None = None,
) -> torch.Tensor:
    """Mean over sequences of each sequence's masked token mean; pass the global sequence count when accumulating."""
    means = per_sequence_means(x, mask, lengths)
    denom = len(means) if num_sequences is None else num_sequences
    return means.sum() / max(denom, 1)


REDUCTIONS = ("token_mean", "sequence_mean")


def reduce_loss(
    x: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor | list[int],
    mode: str,
    *,
    num_tokens: float | None = None,
    num_sequences: int | None = None,
) -> torch.Tensor:
    """Dispatch to one of REDUCTIONS by name."""
    if mode == "token_mean":
        _check_packed(x, mask, lengths)
        return token_mean(x, mask, num_tokens)
    if mode == "sequence_mean":
        return sequence_mean(x, mask, lengths, num_sequences)
    raise ValueError(f"unknown loss reduction {mode!r}; valid: {', '.join(REDUCTIONS)}")
