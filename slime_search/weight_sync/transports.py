"""Weight sync after a training step: Megatron shards -> full HF weights -> inference engines, by one transport.

Every transport speaks SGLang's HTTP API, runs on the driver against the train group (`RayTrainGroup`; each rank's
half is `slime_search.weight_sync.rank`) and the engines' own addresses, and is chosen once, by name, from
`TRANSPORTS` (`--update-weight-transport`):
* nccl (`broadcast.py`): actor rank 0 broadcasts bucket by bucket over a process group the engines join (NCCL on
  GPU, gloo with the CPU engine);
* tensor (`tensor_handles.py`): the actor ranks that share a device with an engine hand it handles to their tensors
  (CUDA IPC on GPU, shared memory on CPU);
* disk (`disk.py`): works everywhere. Rank 0 writes an HF checkpoint, and every engine loads it.

Under --lora-sync-from-tensor the adapters alone go to SGLang's LoRA (`lora_adapters.py`), whatever transport is named.

The nccl and tensor transports stream. The tensor-parallel shards are gathered and renamed into buckets one unit at a
time: the embedding, a decoder layer, the head (`gather.iter_hf_buckets`). So a push never holds a second copy of the
whole model on the trainer's device. After a push every engine must report the new version, so a rollout never starts on
mixed versions.

Tensor and distributed updates sit in SGLang's weight-update session (/begin_weight_update ... /end_weight_update)
on engines whose SGLang version needs it (0.5.21 and later); the version each engine serves is read from
GET /model_info.

This module is the registry and imports nothing heavy: the flags read it, and an implementation is imported when it is
built. What the transports share is `transport_base.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slime_search.config.cluster import TRANSPORT_NAMES
from slime_search.weight_sync.transport_base import WeightSyncConfig, WeightTransport


@dataclass(frozen=True)
class TransportKind:
    load: Callable[[], type[WeightTransport]]  # the implementation, imported on use
    refused_colocated: str | None = None  # why it cannot reach engines on the trainer's own GPUs (None: it can)


def _disk() -> type[WeightTransport]:
    from slime_search.weight_sync.disk import DiskTransport

    return DiskTransport


def _broadcast() -> type[WeightTransport]:
    from slime_search.weight_sync.broadcast import BroadcastTransport

    return BroadcastTransport


def _tensor_handles() -> type[WeightTransport]:
    from slime_search.weight_sync.tensor_handles import TensorHandleTransport

    return TensorHandleTransport


TRANSPORTS: dict[str, TransportKind] = {
    "disk": TransportKind(_disk),
    "nccl": TransportKind(_broadcast, refused_colocated="NCCL cannot connect two processes on one GPU"),
    "tensor": TransportKind(_tensor_handles),
}
# the flag's choices (config.cluster) name exactly the kinds registered here
if tuple(sorted(TRANSPORTS)) != TRANSPORT_NAMES:
    raise RuntimeError(
        f"config.cluster.TRANSPORT_NAMES {TRANSPORT_NAMES} must name every transport: {sorted(TRANSPORTS)}"
    )


def transport_kind(name: str) -> TransportKind:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; valid: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name]


def default_transport(colocate: bool, engines_on_gpus: bool) -> str:
    """The fastest transport the placement allows: handles to engines on the trainer's GPUs, a broadcast to engines
    on GPUs of their own, else the disk (the CPU engine)."""
    return "tensor" if colocate else "nccl" if engines_on_gpus else "disk"


def create_transport(config: WeightSyncConfig, group, engine_urls: list[str]) -> WeightTransport:
    """The transport the flags chose; under --lora-sync-from-tensor the adapters' own (`lora_adapters.py`), with the
    chosen one beneath it for the frozen base when that comes from --load (push_base_first)."""
    if config.served_adapter is not None:
        from slime_search.weight_sync.lora_adapters import AdapterTransport

        chosen = transport_kind(config.transport).load()
        base = chosen(config, group, engine_urls) if config.push_base_first else None
        return AdapterTransport(config, group, engine_urls, base)
    return transport_kind(config.transport).load()(config, group, engine_urls)
