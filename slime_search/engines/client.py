"""One shared async HTTP client for SGLang-API engines (SGLang's router on GPU, the CPU engine server on CPU)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


# SGLang versions from which tensor and distributed weight updates must sit between /begin_weight_update and
# /end_weight_update (0.5.21 added the session; earlier versions have no such endpoints).
UPDATE_SESSION_FROM = (0, 5, 21)


class EngineError(RuntimeError):
    """The engine answered with an error or could not be reached (`status`: the HTTP status, if any)."""

    def __init__(self, message: str, status: int | None = None, timed_out: bool = False):
        super().__init__(message)
        self.status = status
        self.timed_out = timed_out


def release_of(version: str) -> tuple[int, ...]:
    """(0, 5, 23) of "0.5.23", "0.5.23.post1" or "0.5.23rc0": the numeric release, for comparisons."""
    import re

    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def needs_update_session(version: str) -> bool:
    return release_of(version) >= UPDATE_SESSION_FROM


def _decode(text: str) -> Any:
    """SGLang answers JSON, plain text (/flush_cache) or an empty body (/health, /abort_request)."""
    import json

    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


# Answers after which the same request may succeed: the engine (or the router's worker) is restarting or overloaded.
TRANSIENT_STATUSES = (502, 503, 504)


def is_transient(err: EngineError) -> bool:
    """A fault after which the same request may succeed: 502/503/504, or no answer at all short of a timeout (a
    connection refused or reset). Timeouts are not (a frozen engine would cost the bound again) and neither is any
    other answer (the request itself is at fault)."""
    return err.status in TRANSIENT_STATUSES or (err.status is None and not err.timed_out)


@dataclass(frozen=True)
class EngineClientConfig:
    base_url: str
    timeout_s: float = 600.0  # one request, end to end (--engine-timeout): a frozen engine fails after this
    connect_timeout_s: float = 10.0
    max_connections: int = 1024
    generate_retries: int = 2  # re-sends of a /generate that met a transient fault (--engine-retries)
    backoff_s: float = 0.5  # before the first re-send; doubled each time
    lora_path: str | None = None  # the adapter every /generate names (SGLang's field), under --lora-sync-from-tensor


def generate_payload(
    sampling_params: dict[str, Any],
    input_ids: list[int] | None,
    text: str | None,
    return_logprob: bool,
    rid: str | None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    if (input_ids is None) == (text is None):
        raise ValueError("pass exactly one of input_ids or text")
    payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": return_logprob}
    payload["input_ids" if input_ids is not None else "text"] = input_ids if input_ids is not None else text
    if rid is not None:
        payload["rid"] = rid
    if lora_path is not None:
        payload["lora_path"] = lora_path
    return payload


class EngineClient:
    """Pooled connections, created lazily inside the running event loop; close() when done."""

    def __init__(self, config: EngineClientConfig):
        self.config = config
        self._session = None
        self._loop = None

    async def _get_session(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s)
            connector = aiohttp.TCPConnector(limit=self.config.max_connections)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
            self._loop = loop
        return self._session

    async def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        import aiohttp

        session = await self._get_session()
        url = f"{self.config.base_url}{path}"
        try:
            async with session.request(method, url, json=payload) as response:
                body = _decode(await response.text())
                if response.status >= 400:
                    raise EngineError(f"{method} {path} -> HTTP {response.status}: {body}", response.status)
                return body
        except TimeoutError as err:
            message = f"{method} {url} gave no answer within {self.config.timeout_s:g} s"
            raise EngineError(message, timed_out=True) from err
        except aiohttp.ClientError as err:
            raise EngineError(f"{method} {url} failed: {type(err).__name__}: {err}") from err

    async def _request_with_retries(self, method: str, path: str, payload: dict) -> Any:
        """A request that is safe to send again (a generation from token ids: nothing was kept of a failed one),
        re-sent after a transient fault (`is_transient`)."""
        for attempt in range(self.config.generate_retries + 1):
            try:
                return await self._request(method, path, payload)
            except EngineError as err:
                if not is_transient(err) or attempt == self.config.generate_retries:
                    raise EngineError(f"{err} (attempt {attempt + 1})", err.status, err.timed_out) from err
            await asyncio.sleep(self.config.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def generate(
        self,
        sampling_params: dict[str, Any],
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> dict:
        """One generation, re-sent after a transient fault at most `generate_retries` times."""
        payload = generate_payload(sampling_params, input_ids, text, return_logprob, rid, self.config.lora_path)
        return await self._request_with_retries("POST", "/generate", payload)

    async def generate_once(
        self, sampling_params: dict[str, Any], *, input_ids: list[int], return_logprob: bool = True
    ) -> dict:
        """One generation, one attempt (an EnginePool decides where a failed one goes next)."""
        payload = generate_payload(sampling_params, input_ids, None, return_logprob, None, self.config.lora_path)
        return await self._request("POST", "/generate", payload)

    async def input_log_probs(self, token_ids: list[int], lora_path: str | None = None) -> list[float]:
        """The engine's log-probs of token_ids[1:], each given the tokens before it: one prefill, teacher-forced, no
        token generated (SGLang's input_token_logprobs from logprob_start_len 0, whose first entry has none). They are
        of the model's own distribution, temperature 1: SGLang 0.5.23 divides by a request's temperature only for
        the tokens it samples. `lora_path`: the adapter the policy is served as, if any."""
        payload = {
            "input_ids": list(token_ids),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            **({"lora_path": lora_path} if lora_path is not None else {}),
        }
        entries = (await self._request("POST", "/generate", payload))["meta_info"]["input_token_logprobs"]
        if [token for _, token, _ in entries] != list(token_ids):
            raise EngineError(f"{self.config.base_url}: input log-probs of other tokens than those sent")
        return [float(log_prob) for log_prob, _, _ in entries[1:]]

    async def health(self) -> None:
        """Raises unless the engine answers 200 (SGLang's /health runs a one-token generation)."""
        await self._request("GET", "/health")

    async def health_generate(self) -> None:
        """Raises unless the engine generates one token (SGLang's /health_generate; the CPU engine's too)."""
        await self._request("GET", "/health_generate")

    async def model_info(self) -> dict:
        return await self._request("GET", "/model_info")

    async def server_info(self) -> dict:
        return await self._request("GET", "/server_info")

    async def version(self) -> str:
        """The SGLang version the engine reports (the CPU engine reports the version whose API it serves)."""
        return str((await self.server_info())["version"])

    async def weight_version(self) -> str:
        """The weight version the engine serves (GET /model_info)."""
        return str((await self.model_info())["weight_version"])

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        """Answers {success, message, num_paused_requests}; read the served version with weight_version()."""
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._request("POST", "/update_weights_from_disk", payload)

    async def begin_weight_update(self) -> dict:
        """Open the weight-update session tensor and distributed updates need (SGLang >= 0.5.21)."""
        return await self._request("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> dict:
        return await self._request("POST", "/end_weight_update", {})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's memory hand-over to a colocated trainer; tags: weights, kv_cache, cuda_graph (None: all)."""
        await self._request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._request("POST", "/resume_memory_occupation", {"tags": tags})

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        """Any other POST of SGLang's API (the weight-update group calls, for example)."""
        return await self._request("POST", path, payload)

    async def pause_generation(self, mode: str = "retract") -> dict:
        """SGLang's pause: no request starts decoding until continue_generation. "retract" stops running requests
        and keeps their output: after the pause they go on (re-prefilled under the weights served then) and answer
        once, their `meta_info.weight_versions` saying which tokens each version generated; "abort" ends them."""
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/continue_generation", {})

    async def flush_cache(self, timeout_s: float = 0.0) -> str:
        """SGLang answers in plain text, 400 when it is not idle (a request running or waiting). With `timeout_s` it
        waits that long for idleness before answering 400 (SGLang >= 0.5.23; earlier versions answer at once)."""
        return await self._request("POST", f"/flush_cache?timeout={timeout_s:g}" if timeout_s else "/flush_cache")

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its exact rid) or, without one, every request."""
        await self._request("POST", "/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


async def call_engine(url: str, method: str, *args, **kwargs):
    """One EngineClient call on a short-lived client: weight sync and memory hand-over are once per step, so they
    need no pooled connections."""
    client = EngineClient(EngineClientConfig(url))
    try:
        return await getattr(client, method)(*args, **kwargs)
    finally:
        await client.close()


async def on_every_engine(urls: list[str], call: Callable[[str], Awaitable[T]]) -> list[T]:
    """`call(url)` for every engine, concurrently; the answers in the order of `urls`."""
    return list(await asyncio.gather(*(call(url) for url in urls)))


@dataclass(frozen=True)
class IdleWait:
    """How a memory release waits for its engine to be idle (`release_memory_when_idle`)."""

    deadline_s: float = 30.0  # for the requests still there to finish on their own
    abort_grace_s: float = 30.0  # then, after aborting every request, for the engine to drop them
    flush_timeout_s: float = 10.0  # one /flush_cache?timeout= wait
    retry_pause_s: float = 0.2  # between a refused flush and the next


async def flush_when_idle(client: EngineClient, within_s: float, wait: IdleWait) -> bool:
    """Flush the engine's cache once it is idle, trying for `within_s` seconds; whether it got there."""
    deadline = time.monotonic() + within_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            await client.flush_cache(min(wait.flush_timeout_s, remaining))
            return True
        except EngineError as err:
            if err.status != 400:  # 400: not idle (yet), or another flush is waiting
                raise
        await asyncio.sleep(wait.retry_pause_s)
    return False


async def release_memory_when_idle(url: str, tags: list[str] | None, wait: IdleWait = IdleWait()) -> None:  # noqa: B008
    """SGLang's memory release, on an idle engine only: SGLang asserts idleness, and a release while a request is
    running or waiting ends the whole engine process. Requests still there after `wait.deadline_s` (a generation its
    client gave up on keeps running in SGLang) are aborted first."""
    client = EngineClient(EngineClientConfig(url))
    try:
        if not await flush_when_idle(client, wait.deadline_s, wait):
            logger.warning(
                "engine %s still had requests running %g s after generation ended: they are aborted before its memory "
                "goes to the trainer (requests a client stops waiting for keep running in the engine)",
                url,
                wait.deadline_s,
            )
            await client.abort()
            if not await flush_when_idle(client, wait.abort_grace_s, wait):
                raise EngineError(
                    f"engine {url} is not idle {wait.abort_grace_s:g} s after every request was aborted; its memory "
                    "is not released (SGLang would exit on a release now)"
                )
        await client.release_memory(tags)
    finally:
        await client.close()


def check_success(url: str, what: str, answer: dict) -> dict:
    """SGLang's control endpoints answer {"success": bool, "message": str}; a failure becomes an EngineError."""
    if not answer.get("success", False):
        raise EngineError(f"engine {url}: {what} failed: {answer.get('message', answer)}")
    return answer
