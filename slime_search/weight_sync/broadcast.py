"""Weight sync by collective broadcast: trainer rank 0 -> every engine, over a process group of their own.

This is SGLang's protocol for engines on GPUs of their own, and the CPU engine serves it too (over gloo):

1. The trainer picks a TCP rendezvous address and, while joining it as rank 0, asks every engine to join
   (`POST /init_weights_update_group` with `rank_offset` and `world_size`; an engine of k GPUs takes k ranks).
2. Per bucket of whole tensors, it posts the bucket's names / dtypes / shapes to every engine
   (`POST /update_weights_from_distributed`) and broadcasts the tensors from rank 0 in that order.
   Only the last bucket carries the new `weight_version`, so an engine reports the new version only once it
   holds all of it.
3. `POST /destroy_weights_update_group` when training ends.

`WeightBroadcaster` is rank 0's end (it lives in the rank's actor, `slime_search.weight_sync.rank`);
`BroadcastTransport` drives it from the driver. The group and the dtype names are the wire format both ends speak
(`slime_search.engines.weight_wire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from slime_search.engines.weight_wire import DEFAULT_GROUP_NAME, dtype_name, join_weight_update_group
from slime_search.weight_sync.transport_base import WeightTransport, check_served, served_versions

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


@dataclass(frozen=True)
class BroadcastConfig:
    backend: str  # "nccl" between GPUs, "gloo" on CPU
    bucket_bytes: int = 512 * 1024**2
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = 600.0
    # How long a refused bucket's broadcast may take to report done on our side. An engine that received the bucket
    # and then refused it (a name or shape it does not have) answers as soon as the broadcast ends; the thread that
    # sent it may report a moment later on a busy machine. The group is usable again then.
    refusal_grace_s: float = 10.0


class WeightBroadcaster:
    """Trainer rank 0's end of the weight-update group: connect to the engines once, push after every step."""

    def __init__(self, config: BroadcastConfig):
        self.config = config
        self.group = None
        self.engine_urls: list[str] = []
        self.broken = False  # a broadcast was left pending in the group: no push may use it again

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
        if self.broken:
            raise RuntimeError("an engine refused a bucket mid-push; the weight-update group cannot be used again")
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
            answers = asyncio.gather(
                *(_post(url, "/update_weights_from_distributed", payload) for url in self.engine_urls)
            )
            sending = host_in_thread(broadcast_tensors, self.group, tensors)
            # An engine that refuses a bucket before receiving it (SGLang does, outside a weight-update session)
            # answers at once and never joins the broadcast: fail then (once refusal_grace_s shows the broadcast is
            # still pending), instead of blocking in it until the group's timeout. The group is left with a broadcast
            # nobody receives, so it cannot be used again.
            await asyncio.wait([sending, answers], return_when=asyncio.FIRST_EXCEPTION)
            if answers.done() and answers.exception() is not None and not sending.done():
                await asyncio.wait([sending], timeout=self.config.refusal_grace_s)
                self.broken = not sending.done()
                raise answers.exception()
            await sending
            for url, answer in zip(self.engine_urls, await answers, strict=True):
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
        if not self.broken:  # a broken group still has a broadcast in flight on another thread: leave it be
            dist.destroy_process_group(self.group)
        self.group, self.broken = None, False


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
    from slime_search.engines.client import call_engine

    return await call_engine(url, "post", path, payload)


def _check(url: str, what: str, answer: dict) -> None:
    from slime_search.engines.client import check_success

    check_success(url, what, answer)


class BroadcastTransport(WeightTransport):
    """Rank 0 hosts the weight-update group the engines join once; every push streams the weights through it."""

    uses_update_session = True

    def connect(self) -> None:
        super().connect()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        config = BroadcastConfig(backend, self.config.bucket_bytes)
        self.group.on_all_ranks("connect_engines", self.engine_urls, self.ranks_per_engine, config)

    def push(self, version: str) -> str:
        with self.update_session():
            served = self.group.on_all_ranks("broadcast_weights", version)[0]
        return check_served(served, version)

    def close(self) -> None:
        self.group.on_all_ranks("disconnect_engines")
