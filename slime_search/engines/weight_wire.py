"""The wire formats of weight updates, spoken by both ends: the trainer (slime_search.weight_sync) and the engines
(SGLang, or the CPU engine server).

* Broadcast (SGLang's weight-update group): dtype names as SGLang reads them, joining the group the way SGLang
  creates its side of it, and an engine's receipt of one bucket.
* Tensor handles (SGLang's /update_weights_from_tensor): one serialized payload per engine TP rank. On GPU: a
  flattened bucket of CUDA IPC handles, serialized by SGLang's own `MultiprocessingSerializer` with SGLang's patched
  reductions, which name the device by UUID so that an engine with another CUDA_VISIBLE_DEVICES finds it. On CPU: a
  list of (name, tensor) in the same wire format (base64 of a `ForkingPickler` dump) over named shared-memory files
  (torch's `file_system` sharing strategy; the default file-descriptor one only works between parent and child). The
  CPU engine unpickles with an allowlist: only torch's tensor and storage rebuilders, never arbitrary code.
"""

from __future__ import annotations

import base64
import io
import pickle
from datetime import timedelta
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_GROUP_NAME = "weight_update_group"
_REBUILDERS = "torch.multiprocessing.reductions"


# ---- broadcast over a weight-update group -----------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang reads (`getattr(torch, name)`): 'bfloat16', not 'torch.bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"weights of dtype {dtype} cannot be broadcast (supported: {', '.join(DTYPES)})")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown weight dtype {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def join_weight_update_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float
):
    """Join (or, as rank 0, host) the weight-update process group; blocks until all `world_size` ranks joined.

    The group is created the way SGLang creates its side of it. That is a rendezvous store under a `group_name` prefix
    and a process group that is not torch's default one. So the trainer can join it next to Megatron's own groups.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are the ranks we were given
    return group


def receive_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """An engine's side of a bucket. Everything announced is received before anything is checked, so a bad bucket
    never leaves the trainer waiting on a broadcast nobody receives."""
    import torch.distributed as dist

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    received = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty([int(n) for n in shape], dtype=dtype_from_name(dtype))
        dist.broadcast(tensor, src=0, group=group)
        received[name] = tensor
    return received


# ---- tensor handles -------------------------------------------------------------------------------------------
def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """One rank's payload entry; the tensors must stay alive until the engine has answered. A list of (name, tensor)
    for /update_weights_from_tensor; a dict {name: tensor} for /load_lora_adapter_from_tensors, which reads items()."""
    tensors = named_tensors.values() if isinstance(named_tensors, dict) else [t for _, t in named_tensors]
    if any(t.is_cuda for t in tensors):
        return _sglang_serializer().serialize(named_tensors, output_str=True)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def tensor_bucket_payload(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, str | None, Any]:
    """One rank's /update_weights_from_tensor entry for a bucket, its `load_format`, and what must stay alive until the
    engine has answered.

    CUDA tensors go as one flattened bucket (SGLang's "flattened_bucket"). That is a single IPC handle per bucket
    rather than one per tensor, which the engine would otherwise open hundreds of times per push. CPU tensors go as a
    list of (name, tensor) in shared memory. SGLang reads that list as it is, and so does the CPU engine. A flattened
    bucket, by contrast, is pickled with SGLang's own classes, which a trainer without SGLang cannot load.
    """
    if any(t.is_cuda for _, t in named_tensors):
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        bucket = FlattenedTensorBucket(named_tensors=named_tensors)
        flat = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return _sglang_serializer().serialize(flat, output_str=True), "flattened_bucket", flat
    return serialize_named_tensors(named_tensors), None, named_tensors


def _sglang_serializer():
    """SGLang's serializer with its UUID-keyed CUDA reductions (the module moved between SGLang releases)."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds CPU tensors from shared-memory handles and refuses every other global."""

    def find_class(self, module: str, name: str):
        allowed = (
            (module == _REBUILDERS and name.startswith("rebuild_") and "cuda" not in name)
            or (
                module == "torch"
                and (name in ("Tensor", "Size") or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refused {module}.{name}: a weight payload holds only tensors")
        return super().find_class(module, name)


def deserialize_named_tensors(entry: str, mapping: bool = False) -> dict[str, torch.Tensor]:
    """The CPU engine's side: map the shared memory, check the structure: a list of (name, tensor), or with `mapping`
    a dict {name: tensor} (what /load_lora_adapter_from_tensors is sent)."""
    try:
        data = base64.b64decode(entry, validate=True)
        named = _TensorUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - whatever fails to decode or rebuild is a malformed payload
        raise ValueError(f"bad serialized_named_tensors entry: {type(err).__name__}: {err}") from err
    if mapping:
        if not isinstance(named, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named.items()
        ):
            raise ValueError("a LoRA adapter's serialized_named_tensors entry must be a dict {name: tensor}")
        return named
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise ValueError("a serialized_named_tensors entry must be a list of (name, tensor) pairs")
    return dict(named)
