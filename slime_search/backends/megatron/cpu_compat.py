"""Let Megatron-core run on a machine without CUDA (tests and the CPU run); inactive when CUDA exists.

Megatron-core calls torch.cuda for the current device, RNG state, streams and synchronisation. On a CPU-only
torch those calls raise. `activate()` maps them onto CPU equivalents: the current device is the CPU, the "CUDA"
RNG is the CPU generator, streams are no-op objects, synchronise and empty_cache do nothing. It changes nothing
when torch sees a GPU, and it is idempotent. Everything CPU-specific in the backend lives in this module.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)
_MARK = "_slime_search_cpu_compat"


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def is_active() -> bool:
    return bool(getattr(torch.cuda, _MARK, False))


def activate() -> bool:
    """Install the CPU mappings if CUDA is absent; return whether they are active."""
    if torch.cuda.is_available():
        return False
    if is_active():
        return True
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.device_count = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # The CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all (left as it is).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0

    import megatron.core.tensor_parallel.random as mcore_random

    # Megatron sets the CUDA RNG state through torch.cuda._lazy_call, which never runs without CUDA.
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    setattr(cuda, _MARK, True)
    logger.info("Megatron CPU compatibility active (no CUDA)")
    return True


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked) for causal attention without fused kernels."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1).view(1, 1, seq_len, seq_len)
