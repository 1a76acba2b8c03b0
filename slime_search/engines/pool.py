"""Generation spread over several engines by the client itself, with failover.

A trajectory talks to its engine through a `Route`. The engine is chosen at its first request: the live engine with the
fewest requests in flight. It is kept for the following turns, whose prompts extend the previous one, so the engine's
prefix cache holds most of each. When that engine has a transient fault (connection refused or reset, 502/503/504), or
stops answering within the timeout, it is marked down for this pool. The request goes to another live engine at once. A
generation from token ids keeps nothing of a failed attempt, so sending it again anywhere is safe. With one engine (or
none left alive) a transient fault is re-sent to the same engine after a backoff, as before; a timeout then is final (a
frozen engine would cost the bound again).

SGLang's router is not in this path. With its health checks off, as a colocated engine needs, it keeps sending requests
to a dead engine and answers 500 for each (8 of 8 after one of two engines was killed). Its cache-aware policy also sent
every short prompt of a test to one engine. An engine marked down is tried again after `retry_down_after_s` (a pool can
outlive a rollout: the asynchronous stream keeps one), since the manager restarts a dead engine on its own address;
`mark_up` returns one at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from slime_search.engines.client import EngineClient, EngineClientConfig, EngineError, is_transient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    timeout_s: float = 600.0  # one request, end to end (--engine-timeout)
    retries: int = 2  # attempts after the first, on this engine or another (--engine-retries)
    backoff_s: float = 0.5  # before re-sending to the same engine; doubled each time
    retry_down_after_s: float = 30.0  # an engine marked down is tried again after this long
    lora_path: str | None = None  # the adapter every /generate names (SGLang's field), under --lora-sync-from-tensor


class EnginePool:
    """Pooled clients for every engine; close() when done."""

    def __init__(self, urls: list[str], config: PoolConfig):
        if not urls:
            raise ValueError("an engine pool needs at least one engine address")
        self.config = config
        self.urls = list(dict.fromkeys(urls))
        base = EngineClientConfig("", timeout_s=config.timeout_s, generate_retries=0, lora_path=config.lora_path)
        self.clients = {url: EngineClient(replace(base, base_url=url)) for url in self.urls}
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.down: dict[str, tuple[str, float]] = {}  # engine -> why it was marked down, and when
        self.failovers = 0  # requests moved to another engine after a fault

    def route(self) -> Route:
        return Route(self)

    def is_down(self, url: str) -> bool:
        marked = self.down.get(url)
        return marked is not None and time.monotonic() - marked[1] < self.config.retry_down_after_s

    def live(self) -> list[str]:
        return [url for url in self.urls if not self.is_down(url)]

    def mark_down(self, url: str, reason: str) -> None:
        if not self.is_down(url):
            logger.warning("engine %s marked down: %s", url, reason)
        self.down[url] = (reason, time.monotonic())

    def mark_up(self, url: str) -> None:
        self.down.pop(url, None)

    def least_loaded(self, exclude: str | None = None) -> str | None:
        candidates = [url for url in self.live() if url != exclude]
        return min(candidates, key=lambda url: self.in_flight[url]) if candidates else None

    async def generate_on(self, route: Route, sampling_params: dict[str, Any], input_ids: list[int]) -> dict:
        last: EngineError | None = None
        for attempt in range(self.config.retries + 1):
            url = route.engine()
            self.in_flight[url] += 1
            try:
                return await self.clients[url].generate_once(sampling_params, input_ids=input_ids)
            except EngineError as err:
                if not (is_transient(err) or err.timed_out):
                    raise EngineError(f"{err} (attempt {attempt + 1})", err.status, err.timed_out) from err
                last = err
                if err.status is None:  # no answer at all: the engine is gone or frozen
                    self.mark_down(url, str(err))
                moved = self.least_loaded(exclude=url)
                if moved is not None:
                    self.failovers += 1
                    route.failovers += 1
                    route.url = moved
                    continue
                if err.timed_out:
                    break
            finally:
                self.in_flight[url] -= 1
            await asyncio.sleep(self.config.backoff_s * 2**attempt)
        assert last is not None
        raise EngineError(f"{last} (attempt {attempt + 1})", last.status, last.timed_out) from last

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients.values()))


class Route:
    """The engine one trajectory talks to (see the module's docstring)."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.url: str | None = None
        self.failovers = 0  # times this trajectory moved to another engine after a fault

    def engine(self) -> str:
        if self.url is None or self.pool.is_down(self.url):
            # no live engine left: try the one it had (it may be back), else the first
            self.url = self.pool.least_loaded() or self.url or self.pool.urls[0]
        return self.url

    async def generate(self, sampling_params: dict[str, Any], input_ids: list[int]) -> dict:
        return await self.pool.generate_on(self, sampling_params, input_ids)
