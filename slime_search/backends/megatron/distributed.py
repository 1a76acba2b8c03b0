"""Process-group set-up for the Megatron actor: NCCL on GPU, gloo on CPU (with the CPU compatibility layer)."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy
import torch


def init_megatron(
    rank: int, world_size: int, tp_size: int, master_port: int, master_address: str = "127.0.0.1", seed: int = 1234
) -> None:
    """torch.distributed + Megatron model parallel state for one rank (PP = 1, DP = world / TP). `master_address`:
    rank 0's node (127.0.0.1 only when every rank runs on this machine). `seed` (--seed) seeds Python's, NumPy's and
    torch's RNGs and Megatron's model-parallel RNG tracker (which adds the TP rank), as Megatron's own set-up does."""
    import torch.distributed as dist

    from slime_search.backends.megatron import cpu_compat
    from slime_search.backends.megatron.imports import import_megatron_core

    import_megatron_core()  # first, so that no fused function pulls in the compiler at import
    on_cpu = cpu_compat.activate()
    os.environ["MASTER_ADDR"] = master_address
    os.environ["MASTER_PORT"] = str(master_port)
    if not on_cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "gloo" if on_cpu else "nccl", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
    )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from each TP rank's vocabulary slice (last dimension)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
