"""Pack variable-length samples into one sequence per micro-batch, and split a batch by a token budget.

Packing puts the samples of a micro-batch end to end in a single row (no padding). Positions restart at 0 for
each sample and attention never crosses a sample boundary: on GPU through cumulative sequence lengths
(PackedSeqParams, THD layout), on CPU through an explicit block-diagonal causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [n + 1], int32, sample boundaries
    lengths: list[int]  # total length of each sample
    response_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def attention_mask(self) -> torch.Tensor:
        """Boolean [1, 1, T, T], True = masked: causal within each sample, nothing across samples."""
        total = self.num_tokens
        sample_of = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        same_sample = sample_of[:, None] == sample_of[None, :]
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        return ~(same_sample & causal).view(1, 1, total, total)

    def response_slices(self) -> list[slice]:
        """Positions of each sample's response tokens within the packed row."""
        ends = self.cu_seqlens[1:].tolist()
        return [slice(end - r, end) for end, r in zip(ends, self.response_lengths, strict=True)]


def pack(tokens: list[list[int]], response_lengths: list[int]) -> PackedBatch:
    if not tokens:
        raise ValueError("cannot pack an empty micro-batch")
    lengths = [len(t) for t in tokens]
    for n, r in zip(lengths, response_lengths, strict=True):
        if not 0 < r < n:
            raise ValueError(f"a sample of {n} tokens cannot have a response of {r} (needs a prompt token)")
    flat = [tok for sample in tokens for tok in sample]
    positions = [p for n in lengths for p in range(n)]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return PackedBatch(
        input_ids=torch.tensor([flat], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=cu,
        lengths=lengths,
        response_lengths=list(response_lengths),
    )


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `max_tokens` tokens (a longer sample goes alone).

    Longest first into the first micro-batch with room (first-fit decreasing): fewer, fuller micro-batches than
    taking samples in order, which is what `--use-dynamic-batch-size --max-tokens-per-gpu` is for.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[index] <= max_tokens:
                bins[b].append(index)
                loads[b] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    return [sorted(b) for b in bins]
