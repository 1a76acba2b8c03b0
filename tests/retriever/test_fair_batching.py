"""The retriever's batcher under mixed load: large requests share batches with small ones, and the queue is bounded."""

import asyncio
import threading
from collections import deque

import numpy as np
import pytest

from local_dense_retriever.batching import MicroBatcher, Overloaded, PendingRequest, take_fair_slices


class GatedSearch:
    """Records each batch's queries; the first batch waits until `release` is set, so requests pile up behind it."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.first_started = threading.Event()

    def __call__(self, queries, topk):
        self.calls.append(list(queries))
        if len(self.calls) == 1:
            self.first_started.set()
            assert self.release.wait(30), "the test never released the first batch"
        rows = np.array([[int(q.split("-")[1])] * topk for q in queries], dtype=np.int64)
        return rows, np.ones(rows.shape, dtype=np.float32)


def pending(n: int, name: str, loop: asyncio.AbstractEventLoop) -> PendingRequest:
    return PendingRequest([f"{name}-{i}" for i in range(n)], 1, loop.create_future())


def test_fair_slices_share_a_batch_equally_and_keep_the_rest_in_line():
    loop = asyncio.new_event_loop()
    try:
        big, small, mid = pending(1000, "big", loop), pending(2, "small", loop), pending(100, "mid", loop)
        waiting = deque([big, small, mid])
        slices = take_fair_slices(waiting, 256)
        taken = {"big": 0, "small": 0, "mid": 0}
        for request, start, end in slices:
            taken[request.queries[0].split("-")[0]] += end - start
        # the small request (2 queries) whole; the two large ones share what is left of the budget
        assert taken == {"big": 127, "small": 2, "mid": 100}
        assert list(waiting) == [big] and big.next == 127  # small and mid are whole
        equal = deque([pending(1000, "a", loop), pending(500, "b", loop)])  # large requests alone: equal shares
        assert [e - s for _, s, e in take_fair_slices(equal, 256)] == [128, 128]
        between = deque([pending(1000, "a", loop), pending(500, "b", loop)])  # while small requests keep coming
        assert [e - s for _, s, e in take_fair_slices(between, 256, short_budget=40)] == [20, 20]
        beside = deque([pending(1000, "a", loop), pending(3, "s", loop), pending(500, "b", loop)])
        assert [e - s for _, s, e in take_fair_slices(beside, 256, short_budget=40)] == [18, 3, 18]
        crowd = deque([pending(1000, "a", loop), *(pending(2, f"s{i}", loop) for i in range(30))])
        sizes = [e - s for _, s, e in take_fair_slices(crowd, 256, short_budget=40)]
        assert sizes[0] == 60 and sum(sizes) == 120  # beside 60 small queries the large one takes as many
        alone = deque([pending(1000, "alone", loop)])
        assert [(s, e) for _, s, e in take_fair_slices(alone, 256)] == [(0, 256)]  # alone: the whole budget
        gone = pending(5, "gone", loop)
        gone.future.cancel()  # its caller disconnected
        waiting = deque([gone, pending(3, "x", loop)])
        assert [(r.queries[0], s, e) for r, s, e in take_fair_slices(waiting, 256)] == [("x-0", 0, 3)]
        assert not waiting
        many = deque(pending(2, f"r{i}", loop) for i in range(300))
        first = take_fair_slices(many, 256)
        assert len(first) == 256 and len(many) == 300  # one query each for 256 of them
        assert [r.queries[0] for r in list(many)[:44]] == [f"r{i}-0" for i in range(256, 300)]  # the unserved first
    finally:
        loop.close()


def test_small_requests_are_answered_in_the_next_batch_while_a_large_one_is_still_searched():
    search = GatedSearch()

    async def scenario():
        batcher = MicroBatcher(search, max_batch_size=64, max_wait_s=0.01)
        batcher.start()
        done_order: list[str] = []

        async def submit(name: str, n: int):
            hits = await batcher.submit([f"{name}-{i}" for i in range(n)], 1)
            done_order.append(name)
            return hits

        big = asyncio.create_task(submit("big", 1000))
        await asyncio.get_running_loop().run_in_executor(None, search.first_started.wait, 30)
        smalls = [asyncio.create_task(submit(f"small{j}", 2)) for j in range(5)]
        await asyncio.sleep(0.05)  # the small requests are queued behind the first batch of the large one
        search.release.set()
        results = await asyncio.gather(big, *smalls)
        await batcher.stop()
        return done_order, results, batcher

    done_order, results, batcher = asyncio.run(scenario())
    assert len(search.calls[0]) == 64 and all(q.startswith("big") for q in search.calls[0])
    second = search.calls[1]
    # all five (10 queries) beside big's slice: no small request waits for the whole of the large one
    assert sum(q.startswith("small") for q in second) == 10
    assert done_order[:5] == [f"small{j}" for j in range(5)] and done_order[-1] == "big"
    assert results[0] == [[(i, 1.0)] for i in range(1000)]  # every slice back in its place
    assert sum(len(c) for c in search.calls) == 1010
    assert batcher.pending_queries == 0


def test_beyond_the_pending_bound_a_request_is_refused_with_a_retry_time_and_nothing_is_lost():
    search = GatedSearch()

    async def scenario():
        batcher = MicroBatcher(search, max_batch_size=8, max_wait_s=0.001, max_pending=20)
        batcher.start()
        first = asyncio.create_task(batcher.submit([f"a-{i}" for i in range(16)], 1))
        await asyncio.get_running_loop().run_in_executor(None, search.first_started.wait, 30)
        with pytest.raises(Overloaded, match=r"16 queries are waiting \(--max-pending-queries 20\)") as refused:
            await batcher.submit([f"b-{i}" for i in range(5)], 1)
        fits = asyncio.create_task(batcher.submit(["c-7"], 1))  # 17 <= 20: admitted
        search.release.set()
        results = await asyncio.gather(first, fits)
        alone = await batcher.submit([f"d-{i}" for i in range(50)], 1)  # nothing waiting: a request of any size
        await batcher.stop()
        return refused.value, results, alone, batcher

    refused, results, alone, batcher = asyncio.run(scenario())
    assert 1 <= refused.retry_after_s <= 60
    assert results == [[[(i, 1.0)] for i in range(16)], [[(7, 1.0)]]]
    assert len(alone) == 50
    assert batcher.requests_overloaded == 1 and batcher.pending_queries == 0


def test_a_cancelled_or_failed_request_leaves_the_pending_count_exact():
    def search(queries, topk):
        if any(q.startswith("poison") for q in queries):
            raise RuntimeError("index exploded")
        rows = np.zeros((len(queries), topk), dtype=np.int64)
        return rows, np.ones(rows.shape, dtype=np.float32)

    async def scenario():
        batcher = MicroBatcher(search, max_batch_size=4, max_wait_s=0.001)
        batcher.start()
        poisoned = [f"q-{i}" for i in range(6)] + ["poison-1"]
        results = await asyncio.gather(
            batcher.submit(poisoned, 1), batcher.submit(["ok-1", "ok-2"], 1), return_exceptions=True
        )
        cancelled = asyncio.create_task(batcher.submit([f"c-{i}" for i in range(40)], 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        after = await batcher.submit(["ok-3"], 1)
        await asyncio.sleep(0.05)
        await batcher.stop()
        return results, after, batcher.pending_queries

    results, after, left = asyncio.run(scenario())
    assert isinstance(results[0], RuntimeError) and results[1] == [[(0, 1.0)], [(0, 1.0)]]
    assert after == [[(0, 1.0)]]
    assert left == 0
