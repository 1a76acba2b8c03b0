"""Release the actor's device memory while the engines generate (--colocate), and restore it bit for bit.

Everything the actor keeps between steps (parameters, the DDP gradient buffers, the optimizer's master weights and
moments) lives in a handful of storages. Offloading copies each distinct storage to host memory and shrinks it to
zero bytes; onloading grows it back and copies the bytes in. The gradient buffers are freed without a copy and come
back as zeros: every step zeroes them before its first backward pass, so their bytes are never read again. Views
(parameters and `main_grad` into the DDP buffers) keep pointing at the same storage objects. So nothing has to be
re-wired, and the next step is exactly the step that would have run without the round trip.
"""

from __future__ import annotations

import torch


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors of every torch optimizer inside ours: master parameters and per-parameter state."""
    inner = getattr(optimizer, "adam", None) or getattr(optimizer, "optimizer", None)
    stack, found = [inner], []
    while stack:
        current = stack.pop()
        if current is None:
            continue
        if hasattr(current, "chained_optimizers"):  # Megatron's ChainedOptimizer
            stack.extend(current.chained_optimizers)
            continue
        if not isinstance(current, torch.optim.Optimizer):  # Megatron's wrappers hold the torch one
            stack.append(getattr(current, "optimizer", None))
            continue
        for group in current.param_groups:
            found.extend(group["params"])
        for state in current.state.values():
            found.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return found


def _ddp_buffers(ddp_model) -> list:
    found = []
    for name in ("buffers", "expert_parallel_buffers"):  # Megatron DDP's lists (a plain module's `buffers` is a method)
        buffers = getattr(ddp_model, name, None)
        found.extend(buffers if isinstance(buffers, list) else [])
    return found


def model_tensors(ddp_model) -> list[torch.Tensor]:
    """Parameters and the DDP parameter buffers they are views of."""
    found = list(ddp_model.parameters())
    found.extend(buffer.param_data for buffer in _ddp_buffers(ddp_model) if buffer.param_data is not None)
    return found


def gradient_tensors(ddp_model) -> list[torch.Tensor]:
    """The parameters' `main_grad` and the DDP gradient buffers they are views of."""
    found = [p.main_grad for p in ddp_model.parameters() if getattr(p, "main_grad", None) is not None]
    found.extend(buffer.grad_data for buffer in _ddp_buffers(ddp_model) if buffer.grad_data is not None)
    return found


class StorageOffloader:
    """Host copies of a set of storages while their device memory is given back.

    The host buffers are allocated once and reused by every later round trip of the same storages. For CUDA storages
    they are pinned, for fast copies both ways. So a step costs two copies of the actor's state, not fresh host
    allocations.
    """

    def __init__(self):
        self._backups: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._discarded: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its bytes) freed without a copy
        self._host: dict[tuple[int, int], torch.UntypedStorage] = {}  # (storage id, bytes) -> its host buffer
        self.allocated_bytes = 0  # host memory allocated so far (for reuse across round trips, not per step)

    @property
    def offloaded(self) -> bool:
        return bool(self._backups or self._discarded)

    def _host_buffer(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        # the storage object outlives resize_(0) and resize_ back: its identity keys the buffer across round trips
        key = (storage._cdata, storage.nbytes())
        if key not in self._host:
            pinned = storage.device.type == "cuda"
            self._host[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
            self.allocated_bytes += storage.nbytes()
        return self._host[key]

    def offload(self, tensors: list[torch.Tensor], discard: list[torch.Tensor] = ()) -> int:  # noqa: B006
        """Copy each distinct storage of `tensors` to the host and free it, and free those of `discard` without a copy
        (they come back as zeros); returns the bytes released."""
        if self.offloaded:
            raise RuntimeError("already offloaded: onload() first")
        kept = _distinct_storages(tensors)
        for storage in kept:
            host = self._host_buffer(storage)
            host.copy_(storage)
            self._backups.append((storage, host))
        kept_pointers = {storage.data_ptr() for storage in kept}
        dropped = [s for s in _distinct_storages(discard) if s.data_ptr() not in kept_pointers]
        self._discarded = [(storage, storage.nbytes()) for storage in dropped]
        for storage in kept + dropped:
            storage.resize_(0)
        if any(storage.device.type == "cuda" for storage in kept + dropped):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return sum(host.nbytes() for _, host in self._backups) + sum(size for _, size in self._discarded)

    def onload(self) -> int:
        """Grow every storage back on its device, copy the kept bytes in and zero the discarded ones; returns the bytes
        restored."""
        for storage, host in self._backups:
            storage.resize_(host.nbytes())
            storage.copy_(host)
        for storage, size in self._discarded:
            storage.resize_(size)
            storage.fill_(0)
        storages = [storage for storage, _ in self._backups + self._discarded]
        if any(storage.device.type == "cuda" for storage in storages):
            torch.cuda.synchronize()
        restored = sum(host.nbytes() for _, host in self._backups) + sum(size for _, size in self._discarded)
        self._backups, self._discarded = [], []
        return restored


def _distinct_storages(tensors) -> list[torch.UntypedStorage]:
    """Each non-empty storage under `tensors` once."""
    seen: set[int] = set()
    found = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        found.append(storage)
    return found
