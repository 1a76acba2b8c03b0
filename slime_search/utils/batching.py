"""Collect concurrent requests into batches for one worker thread (the retriever's and the CPU engine's).

A single thread owns the expensive resource (encoder + index, or the model), so it is never used from two
threads at once, and one batched call replaces many small ones. A batch closes when it holds `max_batch_size`
units or `max_wait_s` has passed since its first request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Pending = tuple[Any, asyncio.Future]


class WorkerBatcher:
    def __init__(
        self,
        max_batch_size: int,
        max_wait_s: float,
        thread_name: str,
        size_of: Callable[[Any], int] = lambda item: 1,
    ):
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.size_of = size_of
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.units = 0

    @property
    def queue_depth(self) -> int:
        return self.queue.qsize()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, item: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((item, future))
        return await future

    async def run_in_worker(self, fn: Callable, *args: Any) -> Any:
        """Run `fn` on the worker thread (between batches, never during one)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def collect(self) -> list[Pending]:
        batch = [await self.queue.get()]
        size = self.size_of(batch[0][0])
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while size < self.max_batch_size:
            if self.queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    pending = await asyncio.wait_for(self.queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                pending = self.queue.get_nowait()
            batch.append(pending)
            size += self.size_of(pending[0])
        return batch

    async def process(self, batch: list[Pending]) -> None:
        """Resolve every future of the batch (subclasses run the work on the worker thread)."""
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            batch = await self.collect()
            self.batches += 1
            self.units += sum(self.size_of(item) for item, _ in batch)
            await self.process(batch)


def resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its caller has gone (a cancelled request)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
