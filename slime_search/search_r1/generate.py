"""The Search-R1 multi-turn rollout, as slime's custom generate plugin: token ids in, token ids out.

Each turn sends the engine `input_ids` = prompt + everything so far and appends exactly the ids it generated
(with their log-probs); an observation is tokenised once and appended as ids with loss mask 0. The running
text is never re-tokenised, so the trainer sees the very token stream the engine conditioned on.

    --custom-generate-function-path slime_search.search_r1.generate.generate
    --custom-rm-path slime_search.search_r1.reward.reward_func
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from slime_search.engines.client import EngineError
from slime_search.engines.pool import EnginePool, PoolConfig
from slime_search.search_r1.config import PerRollout, SearchR1Config
from slime_search.search_r1.preflight import check_page_access, check_retriever, check_serper
from slime_search.search_r1.search_clients import (
    LocalSearchClient,
    LocalSearchConfig,
    SearchError,
    SerperClient,
    SerperConfig,
    format_observation,
)
from slime_search.search_r1.serper_budget import BudgetSpent, check_ledger_filesystem
from slime_search.search_r1.tool_format import (
    NATIVE_ACTIONS,
    NO_ACTION,
    bounded_ids,
    native_prompt_ids,
    parse_tool_call,
    tool_response_text,
    user_message_text,
)
from slime_search.types import Sample, Status

ACTIONS = ("search", "answer")  # Search-R1's; --page-access adds "access"
# ASearcher's observation for a page its server does not hold.
PAGE_NOT_FOUND = "No More Information is Found for this URL."
# Search-R1's message after a turn with neither a search nor an answer.
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)


def action_tags(config: SearchR1Config) -> tuple[str, ...]:
    if config.tool_format == "qwen3":
        return NATIVE_ACTIONS
    return (*ACTIONS, "access") if config.page_access else ACTIONS


def turn_action(config: SearchR1Config, turn: Turn) -> tuple[str | None, str, str]:
    """The turn's action as the loop acts on it: ("search" | "access" | "answer" | None, its argument, and why a
    native tool call was not valid ("" otherwise))."""
    if config.tool_format == "qwen3" and turn.action == "tool_call":
        action, value = parse_tool_call(turn.content, config.page_access)
        return (action, value, "") if action else (None, "", value)
    return turn.action, turn.content, ""


@functools.lru_cache(maxsize=4)
def _action_pattern(tags: tuple[str, ...]) -> re.Pattern:
    return re.compile(rf"<({'|'.join(tags)})>(.*?)</\1>", re.DOTALL)


def parse_action(text: str, tags: tuple[str, ...] = ACTIONS) -> tuple[str | None, str]:
    """The first complete action block of a turn (<search>, <answer>, and <access> with page access): (its tag or
    None, its stripped content)."""
    match = _action_pattern(tags).search(text)
    return (match.group(1), match.group(2).strip()) if match else (None, "")


OBS_OPEN, OBS_CLOSE = "\n\n<information>", "</information>\n\n"


def observation_body(docs: list[dict], empty_text: str = "", with_urls: bool = False) -> str:
    """The passages as Search-R1 writes them; `empty_text` for a search that found nothing (Search-R1, local and
    web alike, leaves the block empty); `with_urls` names each passage's page (page access on)."""
    return format_observation(docs, with_urls).strip() or empty_text


def observation_text(docs: list[dict], empty_text: str = "", with_urls: bool = False) -> str:
    return f"{OBS_OPEN}{observation_body(docs, empty_text, with_urls)}{OBS_CLOSE}"


def native_response_ids(tokenizer, config: SearchR1Config, turn: Turn, body: str, cap: int) -> tuple[list[int], bool]:
    """--tool-format qwen3: the tool response in the chat template's form, the body cut to keep it within `cap`."""

    def render(text: str) -> str:
        return tool_response_text(text, turn.end_token, config.enable_thinking)

    return bounded_ids(tokenizer, render, body, cap)


def page_ids(tokenizer, page: dict | None, cap: int) -> tuple[list[int], bool]:
    """An accessed page as an observation of at most `cap` tokens, cut inside its <information> block; ASearcher's
    message for a page the server does not hold."""
    return observation_ids(tokenizer, [], cap, page["contents"] if page is not None else PAGE_NOT_FOUND)


def observation_ids(
    tokenizer, docs: list[dict], cap: int, empty_text: str = "", with_urls: bool = False
) -> tuple[list[int], bool]:
    """Token ids of the observation, at most `cap` of them; returns (ids, truncated).

    Over the cap, the passages are cut and the <information> tags kept, so the policy always sees (and is scored
    on) a well-formed block; cutting the whole string, as Search-R1 does, drops the closing tag and makes the
    trajectory fail the format check through no fault of the policy.
    """
    ids = tokenizer.encode(observation_text(docs, empty_text, with_urls), add_special_tokens=False)
    if len(ids) <= cap:
        return ids, False
    open_ids = tokenizer.encode(OBS_OPEN, add_special_tokens=False)
    close_ids = tokenizer.encode(OBS_CLOSE, add_special_tokens=False)
    body = tokenizer.encode(observation_body(docs, empty_text, with_urls), add_special_tokens=False)
    room = cap - len(open_ids) - len(close_ids)
    if room <= 0:
        return ids[:cap], True
    return open_ids + body[:room] + close_ids, True


# One tokenizer load at a time: the first `from transformers import ...` of two threads at once (an evaluation beside
# the asynchronous rollout stream) can fail in transformers' lazy module ("cannot import name 'AutoTokenizer'").
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(path: str):
    with _TOKENIZER_LOCK:
        return _load_tokenizer(path)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass
class _Resources:
    engines: EnginePool
    search: LocalSearchClient | SerperClient
    search_slots: asyncio.Semaphore
    # Held only around engine calls: a trajectory waiting on its search gives its generation slot to another.
    generation_slots: asyncio.Semaphore

    @classmethod
    def open(cls, config: SearchR1Config) -> _Resources:
        if config.search_backend == "local":
            local = LocalSearchConfig(
                url=config.search_url,
                topk=config.search_topk,
                timeout_s=config.search_timeout,
                retry_window_s=config.search_retry_window,
                retries=config.search_retries,
            )
            search = LocalSearchClient(local)
        else:
            bounds = {
                "timeout_s": config.search_timeout,
                "retries": 3 if config.search_retries is None else config.search_retries,
            }
            serper = SerperConfig(
                endpoint=config.serper_url,
                topk=config.search_topk,
                snippet_only=config.search_snippet_only,
                cache_path=config.serper_cache,
                replay_only=config.serper_replay_only,
                **bounds,
            )
            search = SerperClient(serper, budget=config.serper_budget())
        return cls(
            EnginePool(
                list(config.engine_urls),
                PoolConfig(timeout_s=config.engine_timeout, retries=config.engine_retries, lora_path=config.lora_path),
            ),
            search,
            asyncio.Semaphore(config.search_concurrency),
            asyncio.Semaphore(config.generation_concurrency),
        )

    async def close(self) -> None:
        await self.engines.close()
        await self.search.close()


@dataclass
class Session:
    """What every trajectory of one rollout shares: the settings, the tokenizer, the pooled clients."""

    config: SearchR1Config
    tokenizer: Any
    resources: _Resources


def open_session(args: Any) -> Session:
    config = SearchR1Config.from_args(args)
    return Session(config, load_tokenizer(config.tokenizer_path), _Resources.open(config))


# Built on a rollout's first sample, closed at its end by close_resources (the plugin contract's end-of-rollout hook).
_SESSIONS: PerRollout[Session] = PerRollout(open_session)


def session_for(args: Any) -> Session:
    """This rollout's session (call inside the rollout's event loop)."""
    return _SESSIONS.get(args)


async def close_resources() -> None:
    """Close the running rollout's connection pools (the rollout manager calls it at the end of every rollout)."""
    session = _SESSIONS.pop()
    if session is not None:
        await session.resources.close()


def flags_config(args: Any) -> SearchR1Config:
    """The task's settings from the flags alone, before the engines exist: a placeholder stands in for their address."""
    return SearchR1Config.from_args(argparse.Namespace(**{**vars(args), "engine_urls": ["http://engines.later"]}))


def check_args(args: Any) -> None:
    """Plugin hook, when the command line is parsed: the task's settings build (a ValueError names the flag)."""
    flags_config(args)


def preflight(args: Any) -> None:
    """Plugin hook, before Ray starts: the search backend answers one query (local) or has its key or cache, and a
    budget ledger where its lock holds (Serper; the paid API is not called). RuntimeError naming what failed."""
    config = flags_config(args)
    if config.search_backend == "serper":
        check_serper(config.serper_cache, config.serper_replay_only)
        if config.serper_budget().limited:  # the budget's count must be one every process can trust
            check_ledger_filesystem(config.serper_ledger)
        return
    timeout_s = config.search_preflight_timeout
    if timeout_s > 0:
        check_retriever(config.search_url, timeout_s)
        if config.page_access:
            check_page_access(config.page_access_url, timeout_s)


def search_endpoint(config: SearchR1Config) -> str:
    return config.search_url if config.search_backend == "local" else config.serper_url


def prompt_ids(sample: Sample, tokenizer, apply_chat_template: bool) -> list[int]:
    if sample.tokens:
        return list(sample.tokens)
    prompt = sample.prompt
    if isinstance(prompt, list) or apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer.encode(text, add_special_tokens=False)


def _turn_sampling_params(sampling_params: dict, remaining: int, tags: tuple[str, ...] = ACTIONS) -> dict:
    params = dict(sampling_params)
    params["max_new_tokens"] = min(int(params.get("max_new_tokens", remaining)), remaining)
    params["stop"] = list(dict.fromkeys([*(params.get("stop") or []), *(f"</{tag}>" for tag in tags)]))
    params["no_stop_trim"] = True  # the stop tag is part of what the policy generated and is trained on
    return params


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    session = session_for(args)
    return await run_trajectory(session.config, session.tokenizer, session.resources, sample, sampling_params)


@dataclass(frozen=True)
class Turn:
    """One turn as the engine generated it and as Search-R1 reads it.

    `ids`/`log_probs` are what the policy sampled (trained on, token for token); `text` is what the action parser
    and the reward read: decoded without special tokens and cut right after the first closing tag, as Search-R1
    reads a turn (`skip_special_tokens=True`, then `_postprocess_responses`). The token that completes a tag can
    carry more characters (Qwen2 merges `>.`, `>\\n\\n`, `>",`); they stay in the token stream, which cannot be
    split, but not in the text, so they cannot fail the format check.
    """

    ids: list[int]
    log_probs: list[float]
    versions: list[int]  # the weight version that generated each id (a turn can span a weight push)
    text: str
    action: str | None
    content: str
    end_token: bool  # EOS (or another stop token) ended the turn and is its last id


def first_closing_tag_end(text: str, tags: tuple[str, ...] = ACTIONS) -> int | None:
    """Index just past the first closing action tag (`</search>`, `</answer>`, ...) in `text`, if any."""
    ends = [i + len(closing) for closing in (f"</{t}>" for t in tags) if (i := text.find(closing)) >= 0]
    return min(ends) if ends else None


def output_versions(meta: dict, count: int) -> list[int]:
    """The weight version of each of the `count` output tokens: SGLang's `weight_versions` spans ({"version", "start",
    "end"}: a generation that lived through a weight push names each version's tokens), else `weight_version` for all.
    A version that is not a number (a scripted engine's name) reads as -1."""

    def number(version) -> int:
        return int(version) if str(version).isdigit() else -1

    spans = meta.get("weight_versions") or []
    if not spans:
        return [number(meta.get("weight_version", ""))] * count
    versions = [-1] * count
    for span in spans:
        for i in range(max(0, int(span["start"])), min(count, int(span["end"]))):
            versions[i] = number(span["version"])
    return versions


def read_turn(
    tokenizer, ids: list[int], log_probs: list[float], finish_reason: dict, versions=None, tags=ACTIONS
) -> Turn:
    """The turn's tokens up to the one that completes its first closing tag, and the text Search-R1 would read of them.

    Engines stop there already: this only trims an engine that ignored the stop strings."""
    versions = list(versions) if versions is not None else [-1] * len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    tag_end = first_closing_tag_end(text, tags)
    if tag_end is not None:
        keep = len(ids)
        while keep > 1 and first_closing_tag_end(tokenizer.decode(ids[: keep - 1], skip_special_tokens=True), tags):
            keep -= 1
        ids, log_probs, versions, text = ids[:keep], log_probs[:keep], versions[:keep], text[:tag_end]
    matched = finish_reason.get("matched")
    end_token = isinstance(matched, int) and bool(ids) and ids[-1] == matched
    action, content = parse_action(text, tags)
    return Turn(ids, log_probs, versions, text, action, content, end_token)


def without_end_token(turn: Turn) -> Turn:
    """The turn minus the EOS that ended it: Search-R1 decodes the turn without special tokens and goes on, so a
    trajectory that continues never has an end-of-sequence token in its middle."""
    if not turn.end_token:
        return turn
    return Turn(turn.ids[:-1], turn.log_probs[:-1], turn.versions[:-1], turn.text, turn.action, turn.content, False)


async def run_trajectory(
    config: SearchR1Config, tokenizer, res: _Resources, sample: Sample, sampling_params: dict
) -> Sample:
    native = config.tool_format == "qwen3"
    if native and not sample.tokens:
        sample.tokens = native_prompt_ids(tokenizer, sample.prompt, config.page_access, config.enable_thinking)
    else:
        sample.tokens = prompt_ids(sample, tokenizer, config.apply_chat_template)
    metrics = {"turns": 0, "searches": 0, "invalid_actions": 0, "obs_truncations": 0, "search_latency_s": 0.0}
    metrics.update(search_billed=0, search_cache_hits=0)  # web search: billed API calls, answers from a cache
    metrics.update(search_empty=0)  # searches that found nothing (--empty-search-text is what the policy reads)
    metrics.update(accesses=0, access_missing=0)  # --page-access: pages read, and asked for but not held
    tags = action_tags(config)
    sample.status = Status.COMPLETED
    finish = "stop"
    route = res.engines.route()  # this trajectory's engine: kept across turns (prefix cache), moved on a fault
    turn_limit = config.max_turns + (1 if config.final_turn else 0)
    for turn_index in range(turn_limit):
        remaining = config.max_response_tokens - sample.response_length
        if remaining <= 0:
            sample.status, finish = Status.TRUNCATED, "length"
            break
        try:
            async with res.generation_slots:
                params = _turn_sampling_params(sampling_params, remaining, tags)
                out = await route.generate(params, sample.tokens)
        except EngineError as err:  # the engine is gone or failing: this trajectory is lost, not the rollout
            sample.status, finish = Status.ABORTED, "engine_error"
            sample.metadata["error"] = str(err)
            break
        meta = out["meta_info"]
        reason = meta["finish_reason"]
        log_probs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        ids = [int(i) for i in out["output_ids"]]
        turn = read_turn(tokenizer, ids, log_probs, reason, output_versions(meta, len(ids)), tags)
        action, argument, invalid_call = turn_action(config, turn)
        final = turn_index >= config.max_turns  # the answer-only turn: no more searches
        goes_on = action is None and not final and not config.end_on_no_action and reason["type"] != "abort"
        if goes_on and not native:  # the native format keeps the end-of-turn token: the template's own form
            turn = without_end_token(turn)
        sample.append_response_tokens(
            turn.ids, generated=True, log_probs=turn.log_probs, text=turn.text, versions=turn.versions
        )
        sample.weight_versions.append(str(meta.get("weight_version", "")))
        metrics["turns"] += 1
        if reason["type"] == "abort":
            sample.status, finish = Status.ABORTED, "abort"
            break
        if action == "answer":
            finish = "answer"
            break
        if action is None and config.end_on_no_action and reason["type"] == "length":
            sample.status, finish = Status.TRUNCATED, "length"
            break
        if action is None and config.end_on_no_action and turn.end_token:
            finish = "eos"
            break
        if final:
            finish = "final_turn"
            break
        if action == "search":
            start = time.perf_counter()
            try:
                async with res.search_slots:
                    docs, origin = await res.search.search_with_origin(argument)
            except BudgetSpent as err:  # the run's web-search budget: the run is asked to stop (health guard)
                sample.status, finish = Status.FAILED, "stop_run"
                sample.metadata["error"] = str(err)
                break
            except SearchError as err:
                sample.status, finish = Status.FAILED, "search_error"
                sample.metadata["error"] = f"{search_endpoint(config)}: {err}"  # which retriever failed, by address
                break
            finally:
                metrics["search_latency_s"] += time.perf_counter() - start
            metrics["searches"] += 1
            metrics["search_billed"] += int(origin == "api")
            metrics["search_cache_hits"] += int(origin in ("cache", "shared"))  # shared: another's call, not billed
            metrics["search_empty"] += int(not docs)
            if native:
                body = observation_body(docs, config.empty_search_text, config.page_access)
                obs_ids, truncated = native_response_ids(tokenizer, config, turn, body, config.max_obs_tokens)
            else:
                obs_ids, truncated = observation_ids(
                    tokenizer, docs, config.max_obs_tokens, config.empty_search_text, config.page_access
                )
            metrics["obs_truncations"] += int(truncated)
        elif action == "access":
            try:
                async with res.search_slots:
                    page = await res.search.access(argument, config.page_access_url)
            except SearchError as err:
                sample.status, finish = Status.FAILED, "search_error"
                sample.metadata["error"] = f"{config.page_access_url}: {err}"
                break
            metrics["accesses"] += 1
            metrics["access_missing"] += int(page is None)
            if native:
                body = page["contents"] if page is not None else PAGE_NOT_FOUND
                obs_ids, truncated = native_response_ids(tokenizer, config, turn, body, config.max_page_tokens)
            else:
                obs_ids, truncated = page_ids(tokenizer, page, config.max_page_tokens)
            metrics["obs_truncations"] += int(truncated)
        elif native:  # a malformed tool call answers as its tool response; no action at all, as a user message
            metrics["invalid_actions"] += 1
            ended = turn.end_token
            text = (
                tool_response_text(f"Error: {invalid_call}.", ended, config.enable_thinking)
                if invalid_call
                else user_message_text(NO_ACTION, ended, config.enable_thinking)
            )
            obs_ids = tokenizer.encode(text, add_special_tokens=False)
        else:  # neither search nor answer (EOS, token limit, or a stray tag): Search-R1's message and another turn
            metrics["invalid_actions"] += 1
            obs_ids = tokenizer.encode(INVALID_ACTION, add_special_tokens=False)
        obs_ids = obs_ids[: max(0, config.max_response_tokens - sample.response_length)]
        sample.append_response_tokens(obs_ids, generated=False, text=tokenizer.decode(obs_ids))
    else:
        finish = "max_turns"
    metrics["search_cost_usd"] = metrics["search_billed"] * config.serper_usd_per_call
    ledger = await res.search.ledger_calls() if isinstance(res.search, SerperClient) else None
    if ledger is not None:  # what the run's web search has cost so far, as the budget counts it (every attempt)
        metrics.update(search_ledger_calls=ledger, search_ledger_usd=ledger * config.serper_usd_per_call)
    sample.metrics.update(metrics, response_tokens=sample.response_length, engine_failovers=route.failovers)
    sample.metadata["finish_reason"] = finish
    sample.check_alignment()
    return sample
