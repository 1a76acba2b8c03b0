"""Micro-batching of concurrent search requests onto one worker thread, and an LRU cache of results.

One thread owns the encoder and the index: faiss GPU indexes are not thread-safe, and one batched forward pass
of the encoder is far cheaper than many single-query ones. Requests wait at most `max_wait_s` for company.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

# search(queries, topk) -> (rows [n, topk] int64 with -1 for "no result", scores [n, topk] float32)
SearchFn = Callable[[list[str], int], tuple[np.ndarray, np.ndarray]]
Hits = list[tuple[int, float]]  # (corpus row, score), best first


def normalize_query(query: str) -> str:
    """The cache key: the query with whitespace collapsed (the encoder sees the same text either way)."""
    return " ".join(query.split())


class LRUCache:
    """Query -> hits; used from the event-loop thread only, so it needs no lock."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._data: OrderedDict[tuple[str, int], Hits] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[str, int]) -> Hits | None:
        if self.capacity <= 0:
            self.misses += 1
            return None
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: tuple[str, int], value: Hits) -> None:
        if self.capacity <= 0:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)


def run_search(search: SearchFn, queries: list[str], topk: int) -> list[Hits]:
    """Search unique queries once, return hits per input query, dropping faiss's -1 padding."""
    unique = list(dict.fromkeys(queries))
    rows, scores = search(unique, topk)
    by_query = {
        query: [(int(r), float(s)) for r, s in zip(rows[i], scores[i], strict=True) if r >= 0]
        for i, query in enumerate(unique)
    }
    return [by_query[q] for q in queries]


class MicroBatcher:
    def __init__(self, search: SearchFn, max_batch_size: int = 256, max_wait_s: float = 0.002):
        self.search = search
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.queries = 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, queries: list[str], topk: int) -> list[Hits]:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, topk, future))
        return await future

    async def _collect(self) -> list[_Pending]:
        batch = [await self._queue.get()]
        size = len(batch[0].queries)
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while size < self.max_batch_size:
            if self._queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                item = self._queue.get_nowait()
            batch.append(item)
            size += len(item.queries)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            topk = max(p.topk for p in batch)
            queries = [q for p in batch for q in p.queries]
            self.batches += 1
            self.queries += len(queries)
            try:
                hits = await loop.run_in_executor(self._executor, run_search, self.search, queries, topk)
            except Exception:  # noqa: BLE001 - isolate the culprit: each request is retried on its own
                logger.exception(
                    "batch of %d queries failed; retrying its %d requests one by one", len(queries), len(batch)
                )
                await self._run_individually(batch)
                continue
            start = 0
            for pending in batch:
                part = hits[start : start + len(pending.queries)]
                start += len(pending.queries)
                if not pending.future.done():
                    pending.future.set_result([h[: pending.topk] for h in part])

    async def _run_individually(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        for pending in batch:
            try:
                hits = await loop.run_in_executor(
                    self._executor, run_search, self.search, pending.queries, pending.topk
                )
            except Exception as err:  # noqa: BLE001 - recorded as this request's failure
                if not pending.future.done():
                    pending.future.set_exception(err)
            else:
                if not pending.future.done():
                    pending.future.set_result(hits)
