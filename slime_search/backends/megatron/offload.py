"""Release the actor's device memory while the engines generate (--colocate), and restore it bit for bit.

Everything the actor keeps between steps (parameters, the DDP gradient buffers, the optimizer's master weights and
moments) lives in a handful of storages. Offloading copies each distinct storage to host memory and shrinks it to
zero bytes; onloading grows it back and copies the bytes in. Views (parameters and `main_grad` into the DDP buffers)
keep pointing at the same storage objects, so nothing has to be re-wired and the next step is exactly the step that
would have run without the round trip.
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


def model_tensors(ddp_model) -> list[torch.Tensor]:
    """Parameters, their `main_grad`, and the DDP parameter / gradient buffers they are views of."""
    found = []
    for param in ddp_model.parameters():
        found.append(param)
        if getattr(param, "main_grad", None) is not None:
            found.append(param.main_grad)
    for name in ("buffers", "expert_parallel_buffers"):  # Megatron DDP's lists (a plain module's `buffers` is a method)
        buffers = getattr(ddp_model, name, None)
        for buffer in buffers if isinstance(buffers, list) else []:
            found.extend(t for t in (buffer.param_data, buffer.grad_data) if t is not None)
    return found


class StorageOffloader:
    """Host copies of a set of storages while their device memory is given back.

    The host buffers are allocated once (pinned, for CUDA storages: fast copies both ways) and reused by every later
    round trip of the same storages, so a step costs two copies of the actor's state, not fresh host allocations.
    """

    def __init__(self):
        self._backups: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._host: dict[tuple[int, int], torch.UntypedStorage] = {}  # (storage id, bytes) -> its host buffer
        self.allocated_bytes = 0  # host memory allocated so far (for reuse across round trips, not per step)

    @property
    def offloaded(self) -> bool:
        return bool(self._backups)

    def _host_buffer(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        # the storage object outlives resize_(0) and resize_ back: its identity keys the buffer across round trips
        key = (storage._cdata, storage.nbytes())
        if key not in self._host:
            pinned = storage.device.type == "cuda"
            self._host[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
            self.allocated_bytes += storage.nbytes()
        return self._host[key]

    def offload(self, tensors: list[torch.Tensor]) -> int:
        """Copy each distinct storage to the host and free it; returns the bytes released."""
        if self._backups:
            raise RuntimeError("already offloaded: onload() first")
        seen: set[int] = set()
        on_gpu = False
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            on_gpu = on_gpu or storage.device.type == "cuda"
            host = self._host_buffer(storage)
            host.copy_(storage)
            self._backups.append((storage, host))
        released = sum(host.nbytes() for _, host in self._backups)
        for storage, _ in self._backups:
            storage.resize_(0)
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return released

    def onload(self) -> int:
        """Grow every storage back on its device and copy its bytes in; returns the bytes restored."""
        restored = 0
        for storage, host in self._backups:
            storage.resize_(host.nbytes())
            storage.copy_(host)
            restored += host.nbytes()
        if any(storage.device.type == "cuda" for storage, _ in self._backups):
            torch.cuda.synchronize()
        self._backups = []
        return restored
