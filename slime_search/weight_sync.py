"""Weight sync after a training step: Megatron shards -> full HF weights -> inference engines.

Three transports (`--update-weight-transport`), all through SGLang's HTTP API:
* nccl: actor rank 0 broadcasts bucket by bucket over a process group the engines join
  (slime_search.weight_broadcast; NCCL on GPU, gloo with the CPU engine);
* tensor: the actor ranks engines share a device with hand them tensor handles (slime_search.weight_ipc;
  CUDA IPC on GPU, shared memory on CPU);
* disk: works everywhere. Rank 0 writes an HF checkpoint (safetensors + the original config and tokenizer)
  into a fresh folder, renames it into place, and every engine loads it through `/update_weights_from_disk`
  with the new weight_version.

The nccl and tensor transports stream: the tensor-parallel shards are gathered and renamed one unit (embedding,
decoder layer, head) at a time into buckets (`iter_hf_buckets`), so the push never holds a second copy of the whole
model on the trainer's device.

Engines answer with the version they now serve, which is checked, so a rollout never starts on mixed versions.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_bridge import (
    Qwen2Shape,
    gather_tensor_parallel,
    iter_buckets,
    megatron_conversion_units,
    megatron_to_hf,
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
    local_state: dict[str, torch.Tensor], shape: Qwen2Shape, te_names: bool, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The full weights under HF names in buckets of about `bucket_bytes`, gathered and converted one unit (the
    embedding, a decoder layer, the head) at a time: a rank holds one bucket and one unit, never the whole model.
    Collective over the tensor-parallel group: every rank of the group must draw the same buckets in step."""

    def hf_tensors():
        for unit in megatron_conversion_units(local_state):
            full = gather_full_megatron_state({name: local_state[name] for name in unit})
            for name, tensor in megatron_to_hf_part(full, shape, te_names).items():
                yield name, tensor.contiguous()

    return iter_buckets(hf_tensors(), bucket_bytes)


def write_hf_checkpoint(
    megatron_state: dict[str, torch.Tensor],
    shape: Qwen2Shape,
    original_hf: str | Path,
    out_dir: str | Path,
    te_names: bool,
) -> Path:
    """Write an HF checkpoint atomically: a temporary sibling folder renamed into place when complete."""
    from megatron_bridge.hf_io import save_hf_folder

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    hf_state = megatron_to_hf(megatron_state, shape, te_names=te_names)
    if shape.tie_word_embeddings:
        hf_state.pop("lm_head.weight")
    save_hf_folder(hf_state, Path(original_hf), tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


async def update_engines_from_disk(engine_urls: list[str], model_path: str, weight_version: str) -> list[str]:
    """Every engine loads `model_path`; returns the versions they report (all must equal `weight_version`)."""
    from slime_search.rollout.engine_client import EngineError, call_engine

    async def one(url: str) -> str:
        answer = await call_engine(url, "update_weights_from_disk", model_path, weight_version)
        if not answer.get("success") or str(answer.get("weight_version")) != weight_version:
            raise EngineError(f"engine {url} did not switch to weight version {weight_version}: {answer}")
        return str(answer["weight_version"])

    return await asyncio.gather(*(one(url) for url in engine_urls))


def ranks_per_engine(args, engines: int) -> list[int]:
    """Process-group ranks (GPUs) of each engine; the CPU engine is one rank."""
    return [args.rollout_num_gpus_per_engine if args.rollout_num_gpus else 1] * engines


def connect_engines(args, group, manager) -> None:
    """Once per run, before the first sync: the nccl transport's engines join actor rank 0's process group."""
    import ray

    from slime_search.weight_broadcast import BroadcastConfig

    if args.update_weight_transport != "nccl":
        return
    urls = ray.get(manager.worker_urls.remote())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    config = BroadcastConfig(backend, args.update_weight_buffer_size)
    group.connect_engines(urls, ranks_per_engine(args, len(urls)), config)


def push_weights(args, group, manager, disk_dir: Path, weight_version: str) -> str:
    """The actor's current weights to every engine by the run's transport; returns the version they all serve."""
    import ray

    from slime_search.rollout.engine_client import EngineError
    from slime_search.weight_ipc import push_by_handles

    if args.update_weight_transport == "nccl":
        served = group.broadcast_weights(weight_version)
    elif args.update_weight_transport == "tensor":
        urls = ray.get(manager.worker_urls.remote())
        served = push_by_handles(
            group, urls, ranks_per_engine(args, len(urls)), weight_version, args.update_weight_buffer_size
        )
    else:
        weights = group.write_hf(args.hf_checkpoint, str(disk_dir))
        served = ray.get(manager.update_weights_from_disk.remote(weights, weight_version))
    if any(version != weight_version for version in served):
        raise EngineError(f"engines serve weight versions {served} after the push of version {weight_version}")
    return served[0]
