"""Search-R1 task settings, from CLI flags (`--search-backend`, `--search-url`, `--max-turns`, ...).

The plugins receive the parsed flags with every sample (slime's contract); they build their typed settings once per
rollout (`PerRollout`), and a flag missing from the parser is an error that names it, never a silent default.
"""

from __future__ import annotations

import argparse
import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, TypeVar

from slime_search.utils.flag_fields import add_flags, flag, flag_fields
from slime_search.utils.flag_types import non_negative_float, non_negative_int, positive_float, positive_int

T = TypeVar("T")

SEARCH_BACKENDS = ("local", "serper")
TOOL_FORMATS = ("tags", "qwen3")


def add_search_r1_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("Search-R1 task")
    add_flags(group, SearchR1Config)
    add_flags(group, RewardConfig)
    return parser


@dataclass(frozen=True)
class SearchR1Config:
    engine_urls: tuple[str, ...]  # every engine (the trajectories spread over them) or one address (a router)
    tokenizer_path: str
    lora_path: str | None = None  # the adapter the engines serve the policy as (the manager's `lora_path`), if any
    search_backend: str = flag(
        "local",
        "local: --search-url; serper: web search",
        choices=SEARCH_BACKENDS,
    )
    search_url: str = flag(
        "http://127.0.0.1:8000/retrieve",
        "the local /retrieve endpoint",
    )
    search_topk: int = flag(
        3,
        "documents per search",
        type=positive_int,
    )
    search_concurrency: int = flag(
        256,
        "searches in flight at once",
        type=positive_int,
    )
    generation_concurrency: int = flag(
        256,
        "engine requests in flight (not held while searching)",
        type=positive_int,
    )
    search_timeout: float = flag(
        60.0,
        "seconds one search request may take (each retry again)",
        type=positive_float,
    )
    search_retry_window: float = flag(
        30.0,
        "seconds a failed local search request (network, 5xx, 429, 503) is retried for, with jittered backoff and"
        " the server's Retry-After: long enough for a retriever restart; the last attempt may take "
        "--search-timeout more",
        type=non_negative_float,
    )
    search_retries: int | None = flag(
        None,
        "at most this many retries of a failed search request (default: local, as many as --search-retry-window "
        "allows; Serper, 3)",
        type=non_negative_int,
    )
    empty_search_text: str = flag(
        "No search results are found.",
        "the observation of a search that found nothing (counted as search_empty); '' gives Search-R1's empty "
        "<information></information>",
    )
    engine_timeout: float = flag(
        600.0,
        "seconds one engine request may take (a turn's decode)",
        type=positive_float,
    )
    engine_retries: int = flag(
        2,
        "re-sends of a turn after a transient engine fault",
        type=non_negative_int,
    )
    search_snippet_only: bool = flag(
        True,
        "Serper: the result snippets as passages (--no-search-snippet-only: text around them from the pages)",
    )
    serper_url: str = flag(
        "https://google.serper.dev/search",
        "Serper's search endpoint",
    )
    serper_cache: str | None = flag(
        None,
        "SQLite file caching Serper answers across runs and processes",
    )
    serper_replay_only: bool = flag(
        False,
        "answer Serper searches from --serper-cache only, never calling the API (reproducible evaluation)",
    )
    serper_budget_calls: int | None = flag(
        None,
        "at most this many billed Serper calls over the whole run (cached answers are free)",
        type=non_negative_int,
    )
    serper_budget_usd: float | None = flag(
        None,
        "at most this many dollars of Serper calls over the run, at --serper-usd-per-call",
        type=non_negative_float,
    )
    serper_usd_per_call: float = flag(
        0.001,
        "what one billed Serper call costs you (default: $1 per 1,000 queries); sets the cost in the report",
        type=non_negative_float,
    )
    serper_at_budget: str = flag(
        "stop",
        "at the budget: stop the run with a message, or go on answering from --serper-cache only",
        choices=("stop", "replay"),
    )
    serper_ledger: str | None = flag(
        None,
        "SQLite file counting the run's billed Serper calls (default: serper_spend.sqlite in --save); on a local "
        "disk: one on NFS, Lustre, SMB or GPFS is refused, their file locks are not reliable",
    )
    tool_format: str = flag(
        "tags",
        "tags: Search-R1's <search> query </search>; qwen3: Qwen3's native tool calls (tools declared by the chat"
        " template, <tool_call> JSON, tool responses in the template's form); the answer is <answer> in both",
        choices=TOOL_FORMATS,
    )
    enable_thinking: bool = flag(
        False,
        "--tool-format qwen3: let the model think (<think> ... </think>) before it acts (default: off, the "
        "template's empty think block, as torchtitan's and prime-rl's Qwen3 recipes)",
        negatable=True,
    )
    page_access: bool = flag(
        False,
        "an <access> url </access> action that reads a whole page from the retriever's /access (ASearcher's and "
        "RLinf's local wiki server; start it with --pages-path); off: Search-R1's loop, unchanged",
    )
    access_url: str | None = flag(
        None,
        "the /access endpoint (default: --search-url with /retrieve -> /access)",
    )
    max_page_tokens: int = flag(
        1024,
        "an accessed page's observation cap, in tokens",
        type=positive_int,
    )
    max_turns: int = flag(
        4,
        "search turns before the final answer-only turn",
        type=non_negative_int,
    )
    max_obs_tokens: int = flag(
        500,
        "observation cap per search, in tokens",
        type=non_negative_int,
    )
    max_response_tokens: int = flag(
        4096,
        "total response budget (all turns)",
        type=positive_int,
    )
    final_turn: bool = flag(True, "an answer-only turn after the search turns (--no-final-turn: none)")
    end_on_no_action: bool = flag(
        False,
        "a turn ended by EOS or its token limit with neither search nor answer ends the trajectory (default: "
        "Search-R1's invalid-action message and another turn)",
    )
    search_preflight_timeout: float = flag(
        10.0,
        "seconds the one-query probe of --search-url may take before anything starts (0: no probe)",
        type=non_negative_float,
    )
    apply_chat_template: bool = False  # the training CLI's --apply-chat-template (config.rollout.DataConfig)

    def __post_init__(self) -> None:
        if self.search_backend not in SEARCH_BACKENDS:
            raise ValueError(f"unknown --search-backend {self.search_backend!r}; valid: {', '.join(SEARCH_BACKENDS)}")
        if self.max_turns < 0 or self.max_obs_tokens < 0 or self.max_response_tokens <= 0:
            raise ValueError("--max-turns and --max-obs-tokens must be >= 0 and --max-response-tokens > 0")
        if self.search_timeout <= 0 or (self.search_retries or 0) < 0 or self.search_retry_window < 0:
            raise ValueError("--search-timeout must be > 0, --search-retries and --search-retry-window >= 0")
        if self.engine_timeout <= 0 or self.engine_retries < 0:
            raise ValueError("--engine-timeout must be > 0 and --engine-retries >= 0")
        if self.serper_replay_only and not self.serper_cache:
            raise ValueError("--serper-replay-only needs --serper-cache: the answers are replayed from it")
        if self.max_turns == 0 and not self.final_turn:
            raise ValueError("--max-turns 0 with --no-final-turn leaves no turn to generate in")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"--tool-format must be tags or qwen3, got {self.tool_format!r}")
        if self.page_access and self.search_backend != "local":
            raise ValueError("--page-access reads pages from the local retriever's /access: use --search-backend local")
        budget = self.serper_budget()  # its own checks
        if budget.limited and budget.at_budget == "replay" and not self.serper_cache:
            raise ValueError("--serper-at-budget replay answers from --serper-cache: give one")

    @property
    def page_access_url(self) -> str:
        """--access-url, else the /access endpoint beside --search-url."""
        if self.access_url:
            return self.access_url
        base = self.search_url[: -len("/retrieve")] if self.search_url.endswith("/retrieve") else self.search_url
        return base.rstrip("/") + "/access"

    def serper_budget(self):
        from slime_search.search_r1.serper_budget import SerperBudget

        return SerperBudget(
            self.serper_budget_calls,
            self.serper_budget_usd,
            self.serper_usd_per_call,
            self.serper_at_budget,
            self.serper_ledger,
        )

    @classmethod
    def from_args(cls, args: Any) -> SearchR1Config:
        """The engines are the manager's `engine_urls` (every engine), else its `engine_url` (or slime's router
        address), and the adapter they serve is its `lora_path`; the tokenizer is the HF checkpoint's; every other
        field is the flag of the same name."""
        tokenizer_path = getattr(args, "hf_checkpoint", None) or getattr(args, "tokenizer_path", None)
        if not tokenizer_path:
            raise ValueError("no tokenizer: set --hf-checkpoint (an HF folder with the tokenizer)")
        names = [f.name for f in fields(cls) if f.name not in ("engine_urls", "tokenizer_path", "lora_path")]
        settings = flags_from(args, names)
        if not settings["serper_ledger"] and getattr(args, "save", None):
            from slime_search.search_r1.serper_budget import LEDGER_NAME

            settings["serper_ledger"] = str(Path(args.save) / LEDGER_NAME)  # one budget for the run, kept on resume
        return cls(
            engine_urls=engine_addresses(args),
            tokenizer_path=str(tokenizer_path),
            lora_path=getattr(args, "lora_path", None),
            **settings,
        )


@dataclass(frozen=True)
class RewardConfig:
    """Reward shaping; the defaults give the paper's pure exact-match reward."""

    score: float = 1.0
    structure_format_score: float = flag(
        0.0,
        "reward of a well-formed response with a wrong or no answer; a right answer in a malformed one scores 1 minus "
        "it (Search-R1's structure_format_score)",
        type=float,
    )
    final_format_score: float = flag(
        0.0, "reward of a malformed response with a wrong answer (Search-R1's final_format_score)", type=float
    )
    retrieval_score: float = flag(
        0.0,
        "added to a well-formed wrong answer when a retrieved passage held the right one (Search-R1's retrieval_score)",
        type=float,
    )
    # None: no guard against answer spam
    max_answer_tags: int | None = flag(None, "score 0 above this many <answer> blocks", type=positive_int)

    @classmethod
    def search_r1_v03(cls) -> RewardConfig:
        """The format-reward values of Search-R1 v0.3."""
        return cls(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.0)

    @classmethod
    def from_args(cls, args: Any) -> RewardConfig:
        """The reward shaping flags (--structure-format-score, ...); a flag the parser lacks is an error."""
        return cls(**flags_from(args, [f.name for f in flag_fields(cls)]))


def engine_addresses(args: Any) -> tuple[str, ...]:
    """`args.engine_urls`, else the one address of `args.engine_url` or slime's router flags."""
    urls = getattr(args, "engine_urls", None)
    if urls:
        return tuple(urls)
    engine_url = getattr(args, "engine_url", None) or getattr(args, "sglang_router_url", None)
    if not engine_url:
        ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
        if not ip or not port:
            raise ValueError("no engine address: set args.engine_url or --sglang-router-ip/--sglang-router-port")
        engine_url = f"http://{ip}:{port}"
    return (engine_url,)


def flags_from(args: Any, names: list[str]) -> dict[str, Any]:
    """The values of these flags; an error naming every flag the parser did not define."""
    missing = [name for name in names if not hasattr(args, name)]
    if missing:
        flags = ", ".join(_flag_name(name) for name in missing)
        raise AttributeError(
            f"the parsed flags lack {flags}: build the parser with slime_search.search_r1.config."
            "add_search_r1_arguments (and --apply-chat-template)"
        )
    return {name: getattr(args, name) for name in names}


def _flag_name(dest: str) -> str:
    parser = add_search_r1_arguments(argparse.ArgumentParser())
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action.option_strings[0]
    return "--" + dest.replace("_", "-")


def search_r1_args(**values: Any) -> argparse.Namespace:
    """The task's flags at their defaults, with `values` on top: the `args` a plugin gets from the training CLI
    (for tools and tests that call the plugins directly)."""
    args = add_search_r1_arguments(argparse.ArgumentParser()).parse_args([])
    return argparse.Namespace(**{"apply_chat_template": False, **vars(args), **values})


class PerRollout(Generic[T]):
    """A value a plugin builds from `args` once per rollout. A rollout is one event loop (the RolloutManager runs each
    in its own), so the value is kept per running loop, and forgotten with the loop or by `pop()`."""

    def __init__(self, build: Callable[[Any], T]):
        self._build = build
        self._values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, args: Any) -> T:
        loop = asyncio.get_running_loop()
        built_from, value = self._values.get(loop, (None, None))
        if built_from is not args:
            value = self._build(args)
            self._values[loop] = (args, value)
        return value

    def pop(self) -> T | None:
        """Forget (and return) the value of the running loop's rollout."""
        return self._values.pop(asyncio.get_running_loop(), (None, None))[1]
