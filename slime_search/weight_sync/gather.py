"""The actor's tensor-parallel shards gathered into full weights.

For a disk copy, the whole Megatron state is gathered at once. For the broadcast and tensor-handle pushes, the weights
are streamed under HF names in buckets, one conversion unit at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_bridge import (
    ModelShape,
    gather_tensor_parallel,
    iter_buckets,
    megatron_conversion_units,
    megatron_to_hf_part,
)


def gather_full_megatron_state(local_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective over the tensor-parallel group: every rank gets the unsharded Megatron state dict."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return {k: v.detach().clone() for k, v in local_state.items()}
    group = parallel_state.get_tensor_model_parallel_group()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, tensor in local_state.items():
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return gather_tensor_parallel(shards)


def iter_hf_buckets(
    local_state: dict[str, torch.Tensor], shape: ModelShape, te_names: bool, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The full weights under HF names in buckets of about `bucket_bytes`.

    They are gathered and converted one unit (the embedding, a decoder layer, the head) at a time. A rank holds one
    bucket and one unit, never the whole model. The call is collective over the tensor-parallel group: every rank of
    the group must draw the same buckets in step.
    """

    def hf_tensors():
        for unit in megatron_conversion_units(local_state):
            full = gather_full_megatron_state({name: local_state[name] for name in unit})
            for name, tensor in megatron_to_hf_part(full, shape, te_names).items():
                yield name, tensor.contiguous()

    return iter_buckets(hf_tensors(), bucket_bytes)
