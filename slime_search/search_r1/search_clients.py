"""Search backends for the Search-R1 loop: the local `/retrieve` server and Serper (Google) web search.

Both return, per query, documents in the wiki-18 shape {"contents": '"Title"\\ntext'}, which
`format_observation` renders as Search-R1 does. A search that still fails after bounded retries raises
SearchError, which the generate plugin records as a failed sample (never as an empty observation).
"""

from __future__ import annotations

import asyncio
import html
import logging
import os
import random
from collections import OrderedDict
from dataclasses import dataclass
from html.parser import HTMLParser

logger = logging.getLogger(__name__)


class SearchError(RuntimeError):
    """A search that failed for good (after retries)."""


def format_observation(docs: list[dict]) -> str:
    """Search-R1's `_passages2string`: "Doc i(Title: t) text" per document, one per line."""
    lines = []
    for i, doc in enumerate(docs, 1):
        contents = doc.get("document", doc)["contents"]
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
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
    timeout_s: float = 60.0
    retries: int = 3
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 5.0


class LocalSearchClient:
    """Coalesces concurrent single-query calls into batched /retrieve requests over one pooled session."""

    def __init__(self, config: LocalSearchConfig, seed: int = 0):
        self.config = config
        self._rng = random.Random(seed)
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._flush_task: asyncio.Task | None = None
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

    async def search(self, query: str) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((query, future))
        if len(self._pending) >= self.config.max_batch:
            self._flush_now()
        elif self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_later())
        return await future

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.config.window_ms / 1000.0)
        self._flush_task = None
        self._flush_now()

    def _flush_now(self) -> None:
        batch, self._pending = self._pending[: self.config.max_batch], self._pending[self.config.max_batch :]
        if batch:
            asyncio.get_running_loop().create_task(self._send(batch))
        if self._pending and self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_later())

    async def _send(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        queries = [q for q, _ in batch]
        try:
            results = await self._post_with_retries(queries)
        except SearchError as err:
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), docs in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(docs)

    async def _post_with_retries(self, queries: list[str]) -> list[list[dict]]:
        import aiohttp

        payload = {"queries": queries, "topk": self.config.topk, "return_scores": True}
        last = ""
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(
                    backoff_delay(attempt - 1, self.config.backoff_base_s, self.config.backoff_cap_s, self._rng)
                )
            try:
                session = await self._get_session()
                self.requests_sent += 1
                async with session.post(self.config.url, json=payload) as response:
                    if response.status == 200:
                        result = (await response.json())["result"]
                        if len(result) != len(queries):
                            raise SearchError(f"retriever answered {len(result)} lists for {len(queries)} queries")
                        self.queries_sent += len(queries)
                        return result
                    last = f"HTTP {response.status}: {(await response.text())[:200]}"
                    if 400 <= response.status < 500 and response.status != 429:
                        raise SearchError(f"retriever rejected the request: {last}")
            except (TimeoutError, aiohttp.ClientError) as err:
                last = f"{type(err).__name__}: {err}"
        raise SearchError(f"search failed after {self.config.retries + 1} attempts: {last}")

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page, one line per block, without scripts and styles."""

    SKIP = {"script", "style", "noscript", "head", "template"}
    BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    parser = _TextExtractor()
    parser.feed(page)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def decode_page(raw: bytes, declared: str | None) -> str:
    """Decode with the declared charset when it works, else chardet's guess, else utf-8 with replacement."""
    import chardet

    for encoding in (declared, chardet.detect(raw[:65536]).get("encoding"), "utf-8"):
        if not encoding:
            continue
        try:
            return raw.decode(encoding)
        except (LookupError, UnicodeDecodeError):
            continue
    return raw.decode("utf-8", errors="replace")


def snippet_sentences(snippet: str) -> list[str]:
    """Serper snippets join fragments with '...'; keep fragments long enough to locate in the page."""
    return [part.strip() for part in snippet.split("...") if len(part.strip().split()) > 5]


def page_context(snippet: str, page_text: str) -> str:
    """The paragraphs of the page that contain the snippet's fragments (the snippet itself if none match)."""
    paragraphs = page_text.split("\n")
    flat = [" ".join(p.split()) for p in paragraphs]
    found: list[str] = []
    for fragment in snippet_sentences(snippet):
        fragment = " ".join(fragment.split())
        for paragraph in flat:
            if fragment in paragraph and paragraph not in found:
                found.append(paragraph)
    return "\n".join(found) if found else html.unescape(snippet)


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
    cache_size: int = 10_000


class SerperClient:
    """Serper web search; the API key is read from the environment and never logged or put in errors."""

    def __init__(self, config: SerperConfig, seed: int = 0):
        self.config = config
        key = os.environ.get(config.api_key_env, "")
        if not key:
            raise SearchError(f"Serper needs an API key in the environment variable {config.api_key_env}")
        self._headers = {"X-API-KEY": key, "Content-Type": "application/json"}
        self._semaphore = asyncio.Semaphore(config.concurrency)
        self._cache: OrderedDict[str, list[dict]] = OrderedDict()
        self._rng = random.Random(seed)
        self._session = None

    async def _get_session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        return self._session

    async def search(self, query: str) -> list[dict]:
        key = " ".join(query.split())
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        async with self._semaphore:
            items = (await self._query_with_retries(key)).get("organic", [])[: self.config.topk]
            docs = await self._documents(items)
        self._cache[key] = docs
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return docs

    async def _query_with_retries(self, query: str) -> dict:
        import aiohttp

        body = {"q": query, "num": self.config.topk}
        last = ""
        for attempt in range(self.config.retries + 1):
            delay = 0.0
            try:
                session = await self._get_session()
                async with session.post(self.config.endpoint, json=body, headers=self._headers) as response:
                    if response.status == 200:
                        return await response.json()
                    last = f"HTTP {response.status}"
                    if response.status == 429:
                        delay = _retry_after_seconds(response.headers.get("Retry-After"))
                    elif 400 <= response.status < 500:
                        raise SearchError(f"Serper rejected the query ({last})")
            except (TimeoutError, aiohttp.ClientError) as err:
                last = type(err).__name__
            if attempt < self.config.retries:
                base = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_cap_s, self._rng)
                await asyncio.sleep(max(delay, base))
        raise SearchError(f"Serper search failed after {self.config.retries + 1} attempts ({last})")

    async def _documents(self, items: list[dict]) -> list[dict]:
        if self.config.snippet_only:
            contexts = [
                " ".join(snippet_sentences(item.get("snippet", ""))) or item.get("snippet", "") for item in items
            ]
        else:
            # One fetch per item (empty for items without a link), so pages stay aligned with their items.
            pages = await asyncio.gather(*(self._fetch_page(item.get("link", "")) for item in items))
            contexts = [page_context(item.get("snippet", ""), page) for item, page in zip(items, pages, strict=True)]
        docs = []
        for item, context in zip(items, contexts, strict=True):
            title = item.get("title", "") or "No title."
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
        if self._session is not None and not self._session.closed:
            await self._session.close()


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
