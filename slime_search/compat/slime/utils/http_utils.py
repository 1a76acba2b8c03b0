"""slime.utils.http_utils: `post` with slime's retries, `get`, and the engine count behind the router.

As slime's: `post` sends `payload` as JSON and returns the decoded answer (its text when it is not JSON); any failure
(refused connection, an HTTP error status, a broken answer) is logged and the request sent again a second later, up
to `max_retries` attempts in all, after which the last error is raised. No timeout. `get` tries once.

Clients here are aiohttp sessions (the project's HTTP client library), one per event loop: this project runs each
rollout in an event loop of its own, and a connection pool cannot outlive its loop. `init_http_client(args)` sets the
connection limit slime gives its client (--sglang-server-concurrency x engines). When the engines serve the policy as a
LoRA adapter (--lora-sync-from-tensor: `args.lora_path`), it also sets the adapter that `post` names in every /generate
that names none. Slime's plugins build their payloads themselves; `close_http_client()` (this layer's own) closes the
running loop's session at the end of a rollout. slime's Ray-distributed POST (--use-distributed-post) is not provided.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any

logger = logging.getLogger(__name__)

RETRY_DELAY_S = 1.0  # slime waits a second between attempts
DEFAULT_SERVER_CONCURRENCY = 512  # slime's --sglang-server-concurrency default

_connection_limit = 0  # aiohttp: 0 is no limit; init_http_client sets slime's
_lora_path: str | None = None  # the adapter the engines serve the policy as; init_http_client sets it
_sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its aiohttp session


class HTTPStatusError(RuntimeError):
    """An answer with an error status; `status` and `text` are the server's."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"HTTP {status} from {url}")
        self.status, self.text = status, text


def get_rollout_num_engines(args) -> int:
    """How many engines serve behind the router: --rollout-num-engines if set, else GPUs / GPUs per engine."""
    if (count := getattr(args, "rollout_num_engines", None)) is not None:
        return int(count)
    gpus = getattr(args, "rollout_num_gpus", None) or 0
    per_engine = getattr(args, "rollout_num_gpus_per_engine", None) or 1
    return max(1, gpus // per_engine) if gpus > 0 else 0


def init_http_client(args) -> None:
    """slime's connection limit for `post`: --sglang-server-concurrency per engine; and the adapter every /generate
    names (`args.lora_path`, None when the engines serve plain weights)."""
    global _connection_limit, _lora_path
    _lora_path = getattr(args, "lora_path", None)
    engines = get_rollout_num_engines(args)
    if engines > 0:
        concurrency = getattr(args, "sglang_server_concurrency", None) or DEFAULT_SERVER_CONCURRENCY
        _connection_limit = concurrency * engines


def _session():
    import aiohttp

    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=_connection_limit),
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,  # engine traffic never goes through a system proxy
        )
        _sessions[loop] = session
    return session


async def close_http_client() -> None:
    """Close the running event loop's session (the end of a rollout)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def _decode(content: bytes) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content.decode(errors="replace")


async def _post_once(url: str, payload: dict | None, headers: dict | None) -> Any:
    async with _session().post(url, json=payload or {}, headers=headers) as response:
        content = await response.read()
        if response.status >= 400:
            raise HTTPStatusError(url, response.status, content.decode(errors="replace"))
    return _decode(content)


def with_adapter(url: str, payload: dict | None) -> dict | None:
    """A /generate payload naming the served adapter when it names none (a new dict: the caller's is not changed)."""
    from urllib.parse import urlsplit

    if _lora_path is None or not isinstance(payload, dict) or "lora_path" in payload:
        return payload
    if urlsplit(url).path.rstrip("/").endswith("/generate"):
        return {**payload, "lora_path": _lora_path}
    return payload


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    if max_retries < 1:
        raise ValueError(f"max_retries must be >= 1, got {max_retries}")
    payload = with_adapter(url, payload)
    for attempt in range(1, max_retries + 1):
        try:
            return await _post_once(url, payload, headers)
        except Exception as err:  # noqa: BLE001 - slime retries every failure, then raises the last one
            text = err.text if isinstance(err, HTTPStatusError) else None
            logger.info(
                "Error: %s, retrying... (attempt %d/%d, url=%s, response=%s)", err, attempt, max_retries, url, text
            )
            if attempt >= max_retries:
                logger.info("Max retries (%d) reached, failing... (url=%s)", max_retries, url)
                raise
            await asyncio.sleep(RETRY_DELAY_S)
    raise AssertionError("unreachable")


async def get(url: str) -> Any:
    async with _session().get(url) as response:
        content = await response.read()
        if response.status >= 400:
            raise HTTPStatusError(url, response.status, content.decode(errors="replace"))
    return json.loads(content)
