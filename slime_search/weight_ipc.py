"""Weight sync by tensor handles (SGLang's /update_weights_from_tensor), for engines that share the trainer's device.

Nothing but handles crosses HTTP: each trainer rank serializes a bucket of its HF-named tensors, and the engine maps
the same memory and copies from it.

* GPU (colocated engines): CUDA IPC handles, serialized by SGLang's own `MultiprocessingSerializer` with SGLang's
  patched reductions, which name the device by UUID so that an engine with another CUDA_VISIBLE_DEVICES finds it.
* CPU (the CPU engine): the same wire format (base64 of a `ForkingPickler` dump) over named shared-memory files
  (torch's `file_system` sharing strategy; the default file-descriptor one only works between parent and child).

`serialized_named_tensors` holds one entry per engine TP rank; an entry is a serialized list of (name, tensor).
The engine side here unpickles with an allowlist: only torch's tensor and storage rebuilders, never arbitrary code.
"""

from __future__ import annotations

import base64
import io
import pickle

import torch

_REBUILDERS = "torch.multiprocessing.reductions"


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's payload entry; the tensors must stay alive until the engine has answered."""
    if any(t.is_cuda for _, t in named_tensors):
        return _sglang_serializer().serialize(named_tensors, output_str=True)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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


def deserialize_named_tensors(entry: str) -> dict[str, torch.Tensor]:
    """The CPU engine's side: map the shared memory, check the structure (a list of (name, tensor))."""
    try:
        data = base64.b64decode(entry, validate=True)
        named = _TensorUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, RuntimeError, OSError) as err:
        raise ValueError(f"bad serialized_named_tensors entry: {type(err).__name__}: {err}") from err
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise ValueError("a serialized_named_tensors entry must be a list of (name, tensor) pairs")
    return dict(named)


def engine_payloads(entries: list[str | None], ranks_per_engine: list[int]) -> list[list[str]]:
    """Engine e takes the entries of the ranks it sits on: engines are laid over trainer ranks 0.. in order."""
    payloads, start = [], 0
    for k in ranks_per_engine:
        chunk = entries[start : start + k]
        if len(chunk) < k or any(entry is None for entry in chunk):
            raise ValueError(f"engines need the handles of {sum(ranks_per_engine)} trainer ranks, got {len(entries)}")
        payloads.append(chunk)
        start += k
    return payloads


async def post_bucket(url: str, entries: list[str], weight_version: str | None) -> dict:
    """One bucket to one engine; the bucket carrying `weight_version` (the last) also flushes its cache."""
    from slime_search.rollout.engine_client import call_engine, check_success

    payload = {"serialized_named_tensors": entries, "load_format": None, "flush_cache": weight_version is not None}
    if weight_version is not None:
        payload["weight_version"] = weight_version
    answer = await call_engine(url, "post", "/update_weights_from_tensor", payload)
    return check_success(url, "update_weights_from_tensor", answer)


def push_by_handles(group, engine_urls: list[str], ranks_per_engine: list[int], weight_version: str, bucket_bytes: int):
    """Bucket after bucket from the trainer ranks the engines sit on to those engines; returns the versions they
    serve. `group` is the RayTrainGroup; a rank drops a bucket once every engine has answered for it."""
    import asyncio

    from slime_search.weight_broadcast import served_versions

    async def post_all(payloads: list[list[str]], version: str | None) -> None:
        await asyncio.gather(*(post_bucket(u, p, version) for u, p in zip(engine_urls, payloads, strict=True)))

    group.prepare_weight_handles(bucket_bytes, sum(ranks_per_engine))
    try:
        last = False
        while not last:
            entries, last = group.next_weight_handles()
            asyncio.run(post_all(engine_payloads(entries, ranks_per_engine), weight_version if last else None))
    finally:
        group.finish_weight_handles()
    return asyncio.run(served_versions(engine_urls))
