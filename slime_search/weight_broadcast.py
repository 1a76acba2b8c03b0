"""Weight sync by collective broadcast: trainer rank 0 -> every engine, over a process group of their own.

This is SGLang's protocol for engines on GPUs of their own, and the CPU engine serves it too (over gloo):

1. The trainer picks a TCP rendezvous address and, while joining it as rank 0, asks every engine to join
   (`POST /init_weights_update_group` with `rank_offset` and `world_size`; an engine of k GPUs takes k ranks).
2. Per bucket of whole tensors, it posts the bucket's names / dtypes / shapes to every engine
   (`POST /update_weights_from_distributed`) and broadcasts the tensors from rank 0 in that order.
   Only the last bucket carries the new `weight_version`, so an engine reports the new version only once it
   holds all of it.
3. `POST /destroy_weights_update_group` when training ends.

The group is created the way SGLang creates its side of it (a rendezvous store under a `group_name` prefix and a
process group that is not torch's default one), so the trainer can join it next to Megatron's own groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_GROUP_NAME = "weight_update_group"
T = TypeVar("T")


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
    """Join (or, as rank 0, host) the weight-update process group; blocks until all `world_size` ranks joined."""
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


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last one (draws one item ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def broadcast_tensors(group, tensors: list[torch.Tensor]) -> None:
    """Rank 0's side of a bucket: every tensor in order (the receivers post matching broadcasts)."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)


def receive_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """The CPU engine's side of a bucket. Everything announced is received before anything is checked, so a bad
    bucket never leaves the trainer waiting on a broadcast nobody receives."""
    import torch.distributed as dist

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    received = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty([int(n) for n in shape], dtype=dtype_from_name(dtype))
        dist.broadcast(tensor, src=0, group=group)
        received[name] = tensor
    return received


@dataclass(frozen=True)
class BroadcastConfig:
    backend: str  # "nccl" between GPUs, "gloo" on CPU
    bucket_bytes: int = 512 * 1024**2
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = 600.0


class WeightBroadcaster:
    """Trainer rank 0's end of the weight-update group: connect to the engines once, push after every step."""

    def __init__(self, config: BroadcastConfig):
        self.config = config
        self.group = None
        self.engine_urls: list[str] = []

    def connect(self, engine_urls: list[str], ranks_per_engine: list[int], master_address: str, port: int) -> None:
        """Engines take ranks 1.. in order (an engine of k GPUs k consecutive ranks); the trainer is rank 0."""
        if len(engine_urls) != len(ranks_per_engine):
            raise ValueError(f"{len(engine_urls)} engines but {len(ranks_per_engine)} rank counts")
        offsets = [1 + sum(ranks_per_engine[:i]) for i in range(len(engine_urls))]
        world_size = 1 + sum(ranks_per_engine)

        async def connect_all():
            joins = [
                asyncio.create_task(
                    _post(
                        url,
                        "/init_weights_update_group",
                        {
                            "master_address": master_address,
                            "master_port": port,
                            "rank_offset": offset,
                            "world_size": world_size,
                            "group_name": self.config.group_name,
                            "backend": self.config.backend,
                        },
                    )
                )
                for url, offset in zip(engine_urls, offsets, strict=True)
            ]
            hosting = host_in_thread(
                join_weight_update_group,
                self.config.backend,
                master_address,
                port,
                0,
                world_size,
                self.config.group_name,
                self.config.timeout_s,
            )
            answers = asyncio.gather(*joins)
            # whichever side fails first (an engine refusing to join, or our own rendezvous) fails the connect at
            # once, instead of after the other side's rendezvous timeout
            await asyncio.wait([hosting, answers], return_when=asyncio.FIRST_EXCEPTION)
            if hosting.done() and hosting.exception() is not None:
                raise hosting.exception()
            for url, answer in zip(engine_urls, await answers, strict=True):
                _check(url, "init_weights_update_group", answer)
            return await hosting

        self.group = asyncio.run(connect_all())
        self.engine_urls = list(engine_urls)
        logger.info(
            "weight-update group %s: %d engines, world size %d", self.config.group_name, len(offsets), world_size
        )

    def push(self, named_tensors: dict[str, torch.Tensor], weight_version: str) -> list[str]:
        """Broadcast these tensors in buckets; returns the weight version every engine then serves."""
        from megatron_bridge import iter_buckets

        return self.push_buckets(iter_buckets(named_tensors.items(), self.config.bucket_bytes), weight_version)

    def push_buckets(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], weight_version: str) -> list[str]:
        """Broadcast bucket after bucket; the last carries `weight_version`. A streaming source is drawn one bucket
        ahead (to know which is the last), so it holds at most two buckets at a time."""
        if self.group is None:
            raise RuntimeError("connect() to the engines before pushing weights")
        return asyncio.run(self._push(buckets, weight_version))

    async def _push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], weight_version: str) -> list[str]:
        pushed = 0
        for bucket, last in with_last(buckets):
            tensors = [tensor.detach().contiguous() for _, tensor in bucket]
            payload = {
                "names": [name for name, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
                "group_name": self.config.group_name,
                "flush_cache": last,
                **({"weight_version": weight_version} if last else {}),
            }
            posts = [
                asyncio.create_task(_post(url, "/update_weights_from_distributed", payload)) for url in self.engine_urls
            ]
            await asyncio.to_thread(broadcast_tensors, self.group, tensors)
            for url, answer in zip(self.engine_urls, await asyncio.gather(*posts), strict=True):
                _check(url, "update_weights_from_distributed", answer)
            pushed += 1
        if not pushed:
            raise ValueError("no weights to push")
        return await served_versions(self.engine_urls)

    def close(self) -> None:
        """Engines leave the group first (a destroy that fails is logged: the engine may be gone already)."""
        import torch.distributed as dist

        if self.group is None:
            return

        async def leave_all():
            payload = {"group_name": self.config.group_name}
            return await asyncio.gather(
                *(_post(url, "/destroy_weights_update_group", payload) for url in self.engine_urls),
                return_exceptions=True,
            )

        for url, answer in zip(self.engine_urls, asyncio.run(leave_all()), strict=True):
            if isinstance(answer, Exception) or not answer.get("success", False):
                logger.warning("engine %s did not leave the weight-update group: %s", url, answer)
        dist.destroy_process_group(self.group)
        self.group = None


def host_in_thread(function, *args) -> asyncio.Future:
    """Run a blocking call on a daemon thread: unlike asyncio.to_thread, a call still blocked when the event loop
    ends (a rendezvous nobody else joins) does not hold up the loop's shutdown; it ends at its own timeout."""
    import threading

    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result=None, error=None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            outcome = {"result": function(*args)}
        except Exception as err:  # noqa: BLE001 - handed to the waiting coroutine
            outcome = {"error": err}
        with contextlib.suppress(RuntimeError):  # the loop is gone: the caller gave up on this call already
            loop.call_soon_threadsafe(lambda: settle(**outcome))

    threading.Thread(target=run, name="weight-update-group", daemon=True).start()
    return future


async def _post(url: str, path: str, payload: dict) -> dict:
    from slime_search.rollout.engine_client import call_engine

    return await call_engine(url, "post", path, payload)


async def served_versions(urls: list[str]) -> list[str]:
    """The weight version each engine reports (GET /get_weight_version)."""
    from slime_search.rollout.engine_client import call_engine

    return list(await asyncio.gather(*(call_engine(url, "weight_version") for url in urls)))


def _check(url: str, what: str, answer: dict) -> None:
    from slime_search.rollout.engine_client import check_success

    check_success(url, what, answer)
