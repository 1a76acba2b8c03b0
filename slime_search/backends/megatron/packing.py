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
    cu_seqlens: torch.Tensor  # [segments + 1], int32: sample boundaries, then the padding segment's end if any
    lengths: list[int]  # total length of each sample
    response_lengths: list[int]
    padding: int = 0  # tokens of the padding segment at the end (a segment of its own, never in the loss)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def segment_lengths(self) -> list[int]:
        """The attention segments: every sample, then the padding."""
        return self.lengths + ([self.padding] if self.padding else [])

    def attention_mask(self) -> torch.Tensor:
        """Boolean [1, 1, T, T], True = masked: causal within each segment, nothing across segments."""
        total = self.num_tokens
        segments = self.segment_lengths
        segment_of = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
        same_segment = segment_of[:, None] == segment_of[None, :]
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        return ~(same_segment & causal).view(1, 1, total, total)

    def response_slices(self) -> list[slice]:
        """Positions of each sample's response tokens within the packed row."""
        ends = self.cu_seqlens[1 : 1 + len(self.lengths)].tolist()
        return [slice(end - r, end) for end, r in zip(ends, self.response_lengths, strict=True)]


def pack(tokens: list[list[int]], response_lengths: list[int], multiple: int = 1) -> PackedBatch:
    """The samples end to end in one row, padded at the end to a length that `multiple` divides (sequence parallelism
    splits the row over the tensor-parallel ranks). The padding is a segment of its own: nothing attends across it
    and it holds no response token, so it never reaches the loss."""
    if not tokens:
        raise ValueError("cannot pack an empty micro-batch")
    if multiple < 1:
        raise ValueError(f"the packed length must divide by a positive multiple, got {multiple}")
    lengths = [len(t) for t in tokens]
    for n, r in zip(lengths, response_lengths, strict=True):
        if not 0 < r < n:
            raise ValueError(f"a sample of {n} tokens cannot have a response of {r} (needs a prompt token)")
    padding = -sum(lengths) % multiple
    flat = [tok for sample in tokens for tok in sample] + [0] * padding
    positions = [p for n in lengths for p in range(n)] + list(range(padding))
    segments = lengths + ([padding] if padding else [])
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments), 0)
    return PackedBatch(
        input_ids=torch.tensor([flat], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=cu,
        lengths=lengths,
        response_lengths=list(response_lengths),
        padding=padding,
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
