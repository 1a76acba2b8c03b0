"""Micro-batching of concurrent search requests onto one worker thread, and an LRU cache of results.

One thread owns the encoder and the index: faiss GPU indexes are not thread-safe, and one batched forward pass
of the encoder is far cheaper than many single-query ones. Requests wait at most `max_wait_s` for company, and a
batch is shared fairly among them: a large request is searched slice by slice beside the small ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from slime_search.utils.batching import resolve

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


class Overloaded(RuntimeError):
    """More queries are waiting than --max-pending-queries: answered 503 with a Retry-After of `retry_after_s`."""

    def __init__(self, pending: int, limit: int, retry_after_s: int):
        super().__init__(f"{pending} queries are waiting (--max-pending-queries {limit}); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class PendingRequest:
    """One request's queries, searched in slices; its future resolves when every slice is answered."""

    queries: list[str]
    topk: int
    future: asyncio.Future
    hits: list[Hits | None] = field(init=False)
    next: int = 0  # the first query not yet given to a batch
    answered: int = 0

    def __post_init__(self) -> None:
        self.hits = [None] * len(self.queries)

    @property
    def unbatched(self) -> int:
        return len(self.queries) - self.next


Slice = tuple[PendingRequest, int, int]  # (request, start, end): queries[start:end] go into one batch


SMALL_RECENTLY_S = 1.0  # small requests answered this recently: batches are kept short for the next ones
SHORT_BATCH_S = 0.025  # how long a batch may take while small requests keep coming
MEASURED_BATCH = 32  # batches of at least this many queries measure the search's cost per query


def take_fair_slices(waiting: deque[PendingRequest], budget: int, short_budget: int | None = None) -> list[Slice]:
    """The next batch: one round in which every waiting request, in turn, gets up to an equal share of `budget`.

    A request of 5,000 queries is searched slice by slice, so it cannot hold the worker while small requests queue
    behind it; what it has left waits at the back of the line. Small requests (those a share answers whole) go whole
    into the batch. While small requests keep coming (`short_budget` given), the large ones share what is left of
    `short_budget`. If the small ones take more, the large ones share as many queries as the small ones take (at least a
    query each). So batches stay short, and the next small request waits for little, while the large ones still advance
    every batch. Otherwise they share what is left of `budget` (one request alone: all of it). Requests whose caller has
    gone are dropped. `waiting` is updated in place.
    """
    live = [request for request in waiting if not request.future.done()]  # cancelled, or failed in an earlier slice
    share = max(1, budget // max(1, len(live)))
    small_queries = sum(r.unbatched for r in live if r.unbatched <= share)
    large = sum(r.unbatched > share for r in live)
    if short_budget is None:
        room = budget - small_queries
    else:  # the large ones take what is left of the short budget, or as much as the small ones, whichever is more
        room = min(budget - small_queries, max(short_budget - small_queries, small_queries))
    large_share = max(1, room // large) if large else share
    slices: list[Slice] = []
    served_with_more, not_served = [], []
    for request in live:
        if budget == 0:
            not_served.append(request)  # no room left this round: first in line for the next
            continue
        n = min(share if request.unbatched <= share else large_share, request.unbatched, budget)
        slices.append((request, request.next, request.next + n))
        request.next += n
        budget -= n
        if request.unbatched:
            served_with_more.append(request)
    waiting.clear()
    waiting.extend(not_served + served_with_more)
    return slices


class MicroBatcher:
    """Query batches for the retriever's one worker thread, shared fairly among concurrent requests.

    A batch closes when `max_batch_size` queries are waiting or `max_wait_s` has passed since it began to fill (at
    once when the last batch served a single request); it takes an equal share from every waiting request
    (take_fair_slices). At most `max_pending` queries wait at once: beyond that a request is refused with Overloaded
    (503 + Retry-After) instead of growing the queue without bound.
    """

    def __init__(
        self, search: SearchFn, max_batch_size: int = 256, max_wait_s: float = 0.002, max_pending: int = 1 << 17
    ):
        self.search = search
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_pending = max_pending
        self.waiting: deque[PendingRequest] = deque()
        self.pending_queries = 0  # submitted and not yet answered
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.queries = 0
        self.requests_overloaded = 0
        self._queries_per_s = 0.0  # a moving estimate, for Retry-After
        self._small_at = float("-inf")  # when a request was last answered by a single batch
        self._seconds_per_query: float | None = None  # a moving estimate from batches of MEASURED_BATCH or more
        self._last_batch_requests = 0  # how many requests the last batch answered from

    @property
    def queue_depth(self) -> int:
        """Requests with queries not yet given to a batch."""
        return len(self.waiting)

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def retry_after_s(self) -> int:
        """Seconds until the queries waiting now are likely answered (1 to 60)."""
        if self._queries_per_s <= 0:
            return 1
        return int(min(60, max(1, math.ceil(self.pending_queries / self._queries_per_s))))

    async def submit(self, queries: list[str], topk: int) -> list[Hits]:
        if self.pending_queries and self.pending_queries + len(queries) > self.max_pending:
            self.requests_overloaded += 1
            raise Overloaded(self.pending_queries, self.max_pending, self.retry_after_s())
        request = PendingRequest(queries, topk, asyncio.get_running_loop().create_future())
        self.waiting.append(request)
        self.pending_queries += len(queries)
        assert self._arrived is not None, "start() the batcher before submitting"
        self._arrived.set()
        try:
            return await request.future
        finally:
            self.pending_queries -= len(queries) - request.answered  # what was never answered leaves the count too

    async def _collect(self) -> list[Slice]:
        assert self._arrived is not None
        while not self.waiting:
            self._arrived.clear()
            await self._arrived.wait()
        loop = asyncio.get_running_loop()
        # Waiting for company pays only while requests come together: when the last batch served a single request
        # (a lone client), the wait would be all of its cost.
        wait_s = self.max_wait_s if self._last_batch_requests > 1 else 0.0
        deadline = loop.time() + wait_s
        while sum(r.unbatched for r in self.waiting) < self.max_batch_size:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        small_recently = time.monotonic() - self._small_at < SMALL_RECENTLY_S
        slices = take_fair_slices(self.waiting, self.max_batch_size, self.short_budget() if small_recently else None)
        if any(start == 0 and end == len(request.queries) for request, start, end in slices):
            self._small_at = time.monotonic()
        return slices

    async def _run(self) -> None:
        while True:
            slices = await self._collect()
            if slices:
                await self._process(slices)

    async def _search(self, queries: list[str], topk: int) -> list[Hits]:
        return await asyncio.get_running_loop().run_in_executor(self.executor, run_search, self.search, queries, topk)

    async def _process(self, slices: list[Slice]) -> None:
        self._last_batch_requests = len(slices)
        queries = [q for request, start, end in slices for q in request.queries[start:end]]
        topk = max(request.topk for request, _, _ in slices)
        began = time.perf_counter()
        try:
            hits = await self._search(queries, topk)
        except Exception:  # noqa: BLE001 - isolate the culprit: each slice is retried on its own
            logger.exception("batch of %d queries failed; retrying its %d slices one by one", len(queries), len(slices))
            await self._process_individually(slices)
            return
        self._count(len(queries), time.perf_counter() - began)
        offset = 0
        for request, start, end in slices:
            self._answer(request, start, hits[offset : offset + end - start])
            offset += end - start

    async def _process_individually(self, slices: list[Slice]) -> None:
        for request, start, end in slices:
            if request.future.done():
                continue
            try:
                hits = await self._search(request.queries[start:end], request.topk)
            except Exception as err:  # noqa: BLE001 - recorded as this request's failure
                resolve(request.future, error=err)
            else:
                self._answer(request, start, hits)

    def short_budget(self) -> int:
        """Queries a batch may hold while small requests keep coming: what the search does in SHORT_BATCH_S (a
        sixteenth of the batch size until a batch has measured it), at least 16."""
        if self._seconds_per_query is None:
            return max(16, self.max_batch_size // 16)
        return max(16, min(self.max_batch_size, int(SHORT_BATCH_S / self._seconds_per_query)))

    def _count(self, n: int, seconds: float) -> None:
        self.batches += 1
        self.queries += n
        if n >= MEASURED_BATCH:
            cost = seconds / n
            old = self._seconds_per_query
            self._seconds_per_query = cost if old is None else 0.8 * old + 0.2 * cost
        rate = n / max(seconds, 1e-6)
        self._queries_per_s = rate if self._queries_per_s == 0 else 0.8 * self._queries_per_s + 0.2 * rate

    def _answer(self, request: PendingRequest, start: int, hits: list[Hits]) -> None:
        if request.future.done():  # its caller has gone or another slice failed: submit() has uncounted it
            return
        for i, h in enumerate(hits):
            request.hits[start + i] = h[: request.topk]
        request.answered += len(hits)
        self.pending_queries -= len(hits)
        if request.answered == len(request.queries):
            resolve(request.future, request.hits)
