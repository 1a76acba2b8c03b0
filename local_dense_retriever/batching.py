"""Micro-batching of concurrent search requests onto one worker thread, and an LRU cache of results.

One thread owns the encoder and the index: faiss GPU indexes are not thread-safe, and one batched forward pass
of the encoder is far cheaper than many single-query ones. Requests wait at most `max_wait_s` for company.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from slime_search.utils.batching import WorkerBatcher, resolve

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

    def __len__(self) -> int:
        return len(self._data)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def run_search(search: SearchFn, queries: list[str], topk: int) -> list[Hits]:
    """Search unique queries once, return hits per input query, dropping faiss's -1 padding."""
    unique = list(dict.fromkeys(queries))
    rows, scores = search(unique, topk)
    by_query = {
        query: [(int(r), float(s)) for r, s in zip(rows[i], scores[i], strict=True) if r >= 0]
        for i, query in enumerate(unique)
    }
    return [by_query[q] for q in queries]


class MicroBatcher(WorkerBatcher):
    """Query batches for the retriever: a request of n queries counts n towards the batch size."""

    def __init__(self, search: SearchFn, max_batch_size: int = 256, max_wait_s: float = 0.002):
        super().__init__(max_batch_size, max_wait_s, "retriever", size_of=lambda item: len(item[0]))
        self.search = search

    @property
    def queries(self) -> int:
        return self.units

    async def submit(self, queries: list[str], topk: int) -> list[Hits]:  # type: ignore[override]
        return await super().submit((queries, topk))

    async def process(self, batch) -> None:
        topk = max(item[1] for item, _ in batch)
        queries = [q for item, _ in batch for q in item[0]]
        try:
            hits = await self.run_in_worker(run_search, self.search, queries, topk)
        except Exception:  # noqa: BLE001 - isolate the culprit: each request is retried on its own
            logger.exception(
                "batch of %d queries failed; retrying its %d requests one by one", len(queries), len(batch)
            )
            await self._run_individually(batch)
            return
        start = 0
        for (request_queries, request_topk), future in batch:
            part = hits[start : start + len(request_queries)]
            start += len(request_queries)
            resolve(future, [h[:request_topk] for h in part])

    async def _run_individually(self, batch) -> None:
        for (queries, topk), future in batch:
            try:
                hits = await self.run_in_worker(run_search, self.search, queries, topk)
            except Exception as err:  # noqa: BLE001 - recorded as this request's failure
                resolve(future, error=err)
            else:
                resolve(future, hits)
