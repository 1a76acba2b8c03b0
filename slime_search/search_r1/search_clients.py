"""Search backends for the Search-R1 loop: the local `/retrieve` server and Serper (Google) web search.

Both return, per query, documents in the wiki-18 shape {"contents": '"Title"\\ntext'}, which
`format_observation` renders as Search-R1 does. A search that still fails after bounded retries raises
SearchError, which the generate plugin records as a failed sample (never as an empty observation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from slime_search.search_r1.search_error import SearchError
from slime_search.search_r1.web_pages import decode_page, html_to_text, page_context, snippet_sentences

logger = logging.getLogger(__name__)


def format_observation(docs: list[dict], with_urls: bool = False) -> str:
    """Search-R1's `_passages2string`: "Doc i(Title: t) text" per document, one per line. `with_urls` (page access
    on) adds each document's page address, "Doc i(Title: t)[url] text", for the policy to access."""
    lines = []
    for i, doc in enumerate(docs, 1):
        inner = doc.get("document", doc)
        title, _, text = inner["contents"].partition("\n")
        url = inner.get("url") if with_urls else None
        lines.append(
            f"Doc {i}(Title: {title})[{url}] {text}\n" if isinstance(url, str) else f"Doc {i}(Title: {title}) {text}\n"
        )
    return "".join(lines)


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * (2**attempt)))


@dataclass(frozen=True)
class LocalSearchConfig:
    url: str  # the /retrieve endpoint
    topk: int = 3
    max_batch: int = 64  # queries per coalesced request
    window_ms: float = 5.0  # how long a query waits for company
    timeout_s: float = 60.0  # one HTTP attempt
    retry_window_s: float = 30.0  # retries go on while this much time has not passed since the first attempt
    retries: int | None = None  # at most this many retries as well (None: as many as the window allows)
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 4.0

    @property
    def deadline_s(self) -> float:
        """The longest a search can take: retries for the whole window, the last attempt timing out, and that
        once more for the split into single-query requests after a refused batch."""
        return 2 * (self.retry_window_s + self.timeout_s) + 1.0


def retry_pause(
    attempt: int, retry_after_s: float, elapsed_s: float, config: LocalSearchConfig, rng: random.Random
) -> float | None:
    """Seconds to wait before retry `attempt` (0-based): jittered exponential backoff, at least the server's
    Retry-After; None when the retry would start after the window (or past the retry count): give up."""
    if config.retries is not None and attempt >= config.retries:
        return None
    pause = max(retry_after_s, backoff_delay(attempt, config.backoff_base_s, config.backoff_cap_s, rng))
    if elapsed_s + pause > config.retry_window_s:
        return None
    return pause


def documents_of(hits: object) -> list[dict]:
    """One query's answer, checked: a list of documents that each carry `contents` text (directly, or under
    "document" with scores). SearchError otherwise, so a malformed answer fails this query, not the rollout."""
    if not isinstance(hits, list):
        raise SearchError(f"retriever answered {type(hits).__name__} for a query, not a list of documents")
    for doc in hits:
        inner = doc.get("document", doc) if isinstance(doc, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("contents"), str):
            raise SearchError(f"retriever answered a document without 'contents' text: {str(doc)[:120]}")
    return hits


class _Refused(SearchError):
    """The retriever refused the request (4xx): retrying it unchanged cannot help."""


class LocalSearchClient:
    """Coalesces concurrent single-query calls into batched /retrieve requests over one pooled session.

    Every waiting search is resolved whatever happens to its batch, and none waits past `deadline_s`. A batch the
    server refuses is re-sent one query per request, so only the query at fault fails.
    """

    def __init__(self, config: LocalSearchConfig, seed: int = 0):
        self.config = config
        self._rng = random.Random(seed)
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._flush_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._session = None
        self.requests_sent = 0
        self.queries_sent = 0

    @property
    def batching_factor(self) -> float:
        return self.queries_sent / self.requests_sent if self.requests_sent else 0.0

    async def _get_session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
                connector=aiohttp.TCPConnector(limit=64),
            )
        return self._session

    async def search_with_origin(self, query: str) -> tuple[list[dict], str]:
        """The documents and where they came from: "local", the retriever (never billed)."""
        return await self.search(query), "local"

    async def search(self, query: str) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((query, future))
        if len(self._pending) >= self.config.max_batch:
            self._flush_now()
        elif self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_later())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.deadline_s)
        except TimeoutError:
            raise SearchError(f"no answer from the retriever within {self.config.deadline_s:.0f} s") from None

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.config.window_ms / 1000.0)
        self._flush_task = None
        self._flush_now()

    def _flush_now(self) -> None:
        batch, self._pending = self._pending[: self.config.max_batch], self._pending[self.config.max_batch :]
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)  # a reference until it ends: the loop keeps only weak ones
            task.add_done_callback(self._tasks.discard)
        if self._pending and self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_later())

    async def _send(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        try:
            try:
                answers: list[list[dict] | SearchError] = await self._answers([q for q, _ in batch])
            except _Refused as err:
                if len(batch) == 1:
                    raise
                logger.warning("retriever refused a batch of %d queries (%s); sending them one by one", len(batch), err)
                answers = await asyncio.gather(*(self._single_answer(q) for q, _ in batch))
            for (_, future), answer in zip(batch, answers, strict=True):
                _resolve(future, answer)
        except Exception as err:  # noqa: BLE001 - whatever went wrong, no search is left waiting
            failure = (
                err if isinstance(err, SearchError) else SearchError(f"search failed: {type(err).__name__}: {err}")
            )
            for _, future in batch:
                _resolve(future, failure)
        finally:
            for _, future in batch:
                _resolve(future, SearchError("search abandoned"))

    async def _single_answer(self, query: str) -> list[dict] | SearchError:
        try:
            return (await self._answers([query]))[0]
        except SearchError as err:
            return err

    async def _answers(self, queries: list[str]) -> list[list[dict] | SearchError]:
        """Documents per query (or that query's SearchError) from one request, with bounded retries."""
        payload = {"queries": queries, "topk": self.config.topk, "return_scores": True}
        body = await self._post_with_retries(payload, self.config.url)
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            count = f"{len(result)} lists" if isinstance(result, list) else repr(result)[:60]
            raise SearchError(f"retriever answered {count} for {len(queries)} queries")
        self.queries_sent += len(queries)
        answers: list[list[dict] | SearchError] = []
        for hits in result:
            try:
                answers.append(documents_of(hits))
            except SearchError as err:
                answers.append(err)
        return answers

    async def access(self, url: str, access_url: str) -> dict | None:
        """The page at `url` from the retriever's /access endpoint `access_url` (ASearcher's form: {"urls": [url]} ->
        {"result": [page or null]}); None for a page the server does not hold. SearchError when it fails."""
        body = await self._post_with_retries({"urls": [url]}, access_url)
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != 1:
            raise SearchError(f"page access answered {str(body)[:120]!r}, not one result for one url")
        page = result[0]
        if page is not None and not (isinstance(page, dict) and isinstance(page.get("contents"), str)):
            raise SearchError(f"page access answered a page without 'contents' text: {str(page)[:120]}")
        return page

    async def _post_with_retries(self, payload: dict, url: str) -> object:
        """The answer's JSON. Connection failures, timeouts, 5xx, 429 and 503 are retried with jittered backoff (at
        least the server's Retry-After) for `retry_window_s`: long enough to ride out a retriever restart."""
        import aiohttp

        last, attempts, retry_after = "", 0, 0.0
        started = time.monotonic()
        while True:
            if attempts:
                pause = retry_pause(attempts - 1, retry_after, time.monotonic() - started, self.config, self._rng)
                if pause is None:
                    break
                await asyncio.sleep(pause)
            attempts += 1
            retry_after = 0.0
            try:
                session = await self._get_session()
                self.requests_sent += 1
                async with session.post(url, json=payload) as response:
                    text = await response.text(errors="replace")
                    if response.status == 200:
                        try:
                            return json.loads(text)
                        except (ValueError, RecursionError):
                            raise SearchError(
                                f"retriever answered 200 with a body that is not JSON: {text[:120]!r}"
                            ) from None
                    last = f"HTTP {response.status}: {text[:200]}"
                    if response.status in (429, 503):
                        retry_after = _retry_after_seconds(response.headers.get("Retry-After"))
                    elif 400 <= response.status < 500:
                        raise _Refused(f"retriever rejected the request: {last}")
            except (TimeoutError, aiohttp.ClientError) as err:
                last = f"{type(err).__name__}: {err}"
        seconds = time.monotonic() - started
        raise SearchError(f"search failed after {attempts} attempts over {seconds:.1f} s: {last}")

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _resolve(future: asyncio.Future, answer: list[dict] | SearchError) -> None:
    if future.done():
        return
    if isinstance(answer, SearchError):
        future.set_exception(answer)
    else:
        future.set_result(answer)


@dataclass(frozen=True)
class SerperConfig:
    api_key_env: str = "SERPER_API_KEY"
    endpoint: str = "https://google.serper.dev/search"
    topk: int = 3
    snippet_only: bool = True
    concurrency: int = 32
    timeout_s: float = 30.0
    page_timeout_s: float = 10.0
    retries: int = 3
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    cache_size: int = 10_000  # answers kept in memory
    cache_path: str | None = None  # the SQLite cache shared by runs and processes (--serper-cache)
    replay_only: bool = False  # answers from that cache only; the API is never called (--serper-replay-only)
    share_in_flight: bool = True  # identical queries in flight are sent once (off only to measure what that saves)

    def __post_init__(self) -> None:
        if self.replay_only and not self.cache_path:
            raise ValueError("--serper-replay-only needs --serper-cache: the answers are replayed from it")


# Answers after which an attempt certainly was not billed: Serper could not tell whose account to bill (key refused).
# Every other attempt that may have reached Serper stays counted: a timeout, a dropped connection, a 5xx, a 429 or a
# garbled 200 may each have been billed, and Serper documents no refund for them; an overcount only stops a run early.
NOT_BILLED_STATUSES = (401, 403)


class _Flight:
    """One Serper search in flight and the trajectories waiting on it. A waiter that is cancelled leaves without
    touching the search, which goes on for the others; only when no one waits any more is it cancelled (what it has
    sent stays counted). Its answer or its failure reaches every waiter."""

    def __init__(self, task: asyncio.Task):
        self.task = task
        self.waiters = 0
        self.abandoned = False  # cancelled for want of waiters: a new search of the query starts a flight of its own

    async def wait(self) -> list[dict]:
        self.waiters += 1
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            if self.task.cancelled() and not asyncio.current_task().cancelling():  # the client closed, not us
                raise SearchError("search abandoned: the Serper client closed") from None
            raise
        finally:
            self.waiters -= 1
            if not self.waiters and not self.task.done():
                self.abandoned = True
                self.task.cancel()


class SerperClient:
    """Serper web search; the API key is read from the environment and never logged or put in errors. Answers are
    kept in memory and, with `cache_path`, in a SQLite cache that later runs (and replay-only evaluation) read.
    Identical queries in flight at once (GRPO's samples of one prompt may open with the same query) are sent once."""

    def __init__(self, config: SerperConfig, seed: int = 0, budget=None):
        """`budget`: a serper_budget.SerperBudget capping the run's billed calls (None: no cap)."""
        from slime_search.search_r1.serper_cache import CacheSettings, SerperCache

        self.config = config
        key = os.environ.get(config.api_key_env, "")
        if not key and not config.replay_only:
            raise SearchError(f"Serper needs an API key in the environment variable {config.api_key_env}")
        self._headers = {"X-API-KEY": key, "Content-Type": "application/json"}
        self._semaphore = asyncio.Semaphore(config.concurrency)
        self._cache: OrderedDict[str, list[dict]] = OrderedDict()
        self._in_flight: dict[str, _Flight] = {}
        self._store = SerperCache(config.cache_path) if config.cache_path else None
        self._settings = CacheSettings(config.endpoint, config.topk, config.snippet_only)
        self._rng = random.Random(seed)
        self._session = None
        self.budget = budget if budget is not None and budget.limited else None
        self._ledger = None
        if self.budget is not None:
            from slime_search.search_r1.serper_budget import SpendLedger

            self._ledger = SpendLedger(self.budget.ledger_path)

    async def _get_session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        return self._session

    async def _reserve_call(self, query: str) -> None:
        """One billed call from the run's budget; at the cap, BudgetSpent (stop) or a SearchError (replay). A
        cancellation while the ledger is written may leave the call counted unsent: the count errs towards the cap."""
        if self._ledger is None:
            return
        if await asyncio.to_thread(self._ledger.reserve, self.budget.call_cap):
            return
        from slime_search.search_r1.serper_budget import BudgetSpent

        spent = f"the web-search budget is spent ({self.budget.describe()}: {self.budget.call_cap} billed calls)"
        if self.budget.at_budget == "replay":
            raise SearchError(f"not in the Serper cache {self.config.cache_path} and {spent}: {query[:80]!r}")
        raise BudgetSpent(f"{spent}; the run stops here (--serper-at-budget replay goes on from --serper-cache)")

    async def _give_back_call(self) -> None:
        """An attempt that certainly was not billed returns its reservation (the write ends even if we are
        cancelled: the thread runs on)."""
        if self._ledger is not None:
            await asyncio.to_thread(self._ledger.release)

    async def ledger_calls(self) -> int | None:
        """The billed calls the budget ledger counts now: every attempt Serper may have billed, by every process
        drawing on the budget (the rollouts, an evaluation beside them, the runs before a resume); None without one."""
        if self._ledger is None:
            return None
        return await asyncio.to_thread(self._ledger.spent)

    async def search(self, query: str) -> list[dict]:
        return (await self.search_with_origin(query))[0]

    async def search_with_origin(self, query: str) -> tuple[list[dict], str]:
        """The documents and where they came from: "cache", "api" or "shared".

        "cache" is memory or the SQLite cache, not billed. "api" is sent to Serper and billed, once per attempt.
        "shared" is the answer of an identical query another trajectory had in flight, not billed again."""
        from slime_search.search_r1.serper_cache import normalise_query

        query = " ".join(query.split())
        key = normalise_query(query)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], "cache"
        if self._store is not None:
            stored = await asyncio.to_thread(self._stored_answer, query)
            if stored is not None:
                self._remember(key, stored)
                return stored, "cache"
        if self.config.replay_only:
            raise SearchError(f"not in the Serper cache {self.config.cache_path} (replay-only): {query[:80]!r}")
        if not self.config.share_in_flight:
            return await self._api_search(query, key), "api"
        flight, origin = self._in_flight.get(key), "shared"
        if flight is None or flight.abandoned:
            flight, origin = _Flight(asyncio.get_running_loop().create_task(self._api_search(query, key))), "api"
            self._in_flight[key] = flight
            flight.task.add_done_callback(lambda task: self._landed(key, flight))
        return await flight.wait(), origin

    def _landed(self, key: str, flight: _Flight) -> None:
        if self._in_flight.get(key) is flight:
            del self._in_flight[key]
        if not flight.task.cancelled():
            flight.task.exception()  # seen: every waiter got it, or none was left to

    async def _api_search(self, query: str, key: str) -> list[dict]:
        """Serper's answer as documents, cached. Each attempt is counted before it is sent and stays counted unless it
        certainly was not billed, so a billed answer counts whatever happens after it (a failed page fetch, a
        cancelled trajectory)."""
        async with self._semaphore:
            items = (await self._query_with_retries(query))[: self.config.topk]
            docs = await self._documents(items)
        if self._store is not None:
            await asyncio.to_thread(self._store_answer, query, docs)
        self._remember(key, docs)
        return docs

    def _remember(self, key: str, docs: list[dict]) -> None:
        self._cache[key] = docs
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    def _stored_answer(self, query: str) -> list[dict] | None:
        import sqlite3

        try:
            return self._store.get(query, self._settings)
        except (sqlite3.Error, ValueError) as err:  # an unreadable cache is a search fault, never a crash
            raise SearchError(f"Serper cache {self.config.cache_path} unreadable: {err}") from err

    def _store_answer(self, query: str, docs: list[dict]) -> None:
        import sqlite3

        try:
            self._store.put(query, self._settings, docs)
        except sqlite3.Error as err:  # a full disk or a cache locked too long costs the entry, not the search
            logger.warning("Serper cache %s: could not store an answer: %s", self.config.cache_path, err)

    async def _query_with_retries(self, query: str) -> list[dict]:
        import aiohttp

        body = {"q": query, "num": self.config.topk}
        last = ""
        for attempt in range(self.config.retries + 1):
            delay = 0.0
            await self._reserve_call(query)  # per attempt: a retried attempt may have been billed too
            try:
                session = await self._get_session()
                # No redirects: aiohttp would carry the API key to whatever origin the redirect names.
                async with session.post(
                    self.config.endpoint, json=body, headers=self._headers, allow_redirects=False
                ) as response:
                    if response.status == 200:
                        return serper_answer(await response.text(errors="replace"))
                    last = f"HTTP {response.status}"
                    if response.status in NOT_BILLED_STATUSES:
                        await self._give_back_call()
                    if response.status == 429:
                        delay = _retry_after_seconds(response.headers.get("Retry-After"))
                    elif 300 <= response.status < 400:
                        raise SearchError(f"Serper answered a redirect ({last}); not followed, the key stays here")
                    elif 400 <= response.status < 500:
                        raise SearchError(f"Serper rejected the query ({last})")
            except aiohttp.ClientConnectorError as err:  # no connection (refused, DNS, TLS): nothing was sent
                last = type(err).__name__
                await self._give_back_call()
            except (TimeoutError, aiohttp.ClientError) as err:
                last = type(err).__name__
            except _Malformed as err:  # a garbled answer may be a passing fault: retried like a 5xx
                last = str(err)
            if attempt < self.config.retries:
                base = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_cap_s, self._rng)
                await asyncio.sleep(max(delay, base))
        raise SearchError(f"Serper search failed after {self.config.retries + 1} attempts ({last})")

    async def _documents(self, items: list[dict]) -> list[dict]:
        if self.config.snippet_only:
            contexts = [" ".join(snippet_sentences(item["snippet"])) or item["snippet"] for item in items]
        else:
            # One fetch per item (empty for items without a link), so pages stay aligned with their items.
            pages = await asyncio.gather(*(self._fetch_page(item["link"]) for item in items))
            contexts = [page_context(item["snippet"], page) for item, page in zip(items, pages, strict=True)]
        docs = []
        for item, context in zip(items, contexts, strict=True):
            title = item["title"] or "No title."
            docs.append({"contents": f'"{title}"\n{context or "No snippet available."}'})
        return docs

    async def _fetch_page(self, url: str) -> str:
        import aiohttp

        if not url:
            return ""
        try:
            session = await self._get_session()
            timeout = aiohttp.ClientTimeout(total=self.config.page_timeout_s)
            async with session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    return ""
                return html_to_text(decode_page(await response.read(), response.charset))
        except (TimeoutError, aiohttp.ClientError) as err:
            logger.debug("page fetch failed for %s: %s", url, type(err).__name__)
            return ""

    async def close(self) -> None:
        """Cancels the searches still in flight (their waiters get a SearchError; what they sent stays counted), then
        closes the connection pool."""
        flights = [flight.task for flight in self._in_flight.values()]
        for task in flights:
            task.cancel()
        await asyncio.gather(*flights, return_exceptions=True)
        if self._session is not None and not self._session.closed:
            await self._session.close()


class _Malformed(SearchError):
    """Serper answered 200 with a body that is not its JSON."""


def serper_answer(text: str) -> list[dict]:
    """The organic results of a Serper answer, each with `title`, `link` and `snippet` as text ("" when absent);
    results that are not objects are dropped. _Malformed when the body is not a JSON object with a list there."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise _Malformed(f"Serper answered 200 with a body that is not JSON: {text[:80]!r}") from None
    organic = body.get("organic", []) if isinstance(body, dict) else None
    if not isinstance(organic, list):
        raise _Malformed(f"Serper's answer has no list of organic results: {text[:80]!r}")
    fields = ("title", "link", "snippet")
    return [
        {name: value if isinstance(value := item.get(name), str) else "" for name in fields}
        for item in organic
        if isinstance(item, dict)
    ]


def _retry_after_seconds(value: str | None) -> float:
    """Retry-After as seconds (the HTTP-date form is treated as 'a second')."""
    if value is None:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        return 1.0


__all__ = [
    "LocalSearchClient",
    "LocalSearchConfig",
    "SearchError",
    "SerperClient",
    "SerperConfig",
    "format_observation",
    "html_to_text",
    "page_context",
]
