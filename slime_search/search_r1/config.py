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

from slime_search.utils.flag_types import non_negative_float, non_negative_int, positive_float, positive_int

T = TypeVar("T")

SEARCH_BACKENDS = ("local", "serper")


def add_search_r1_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("Search-R1 task")
    group.add_argument(
        "--search-backend", choices=SEARCH_BACKENDS, default="local", help="local: --search-url; serper: web search"
    )
    group.add_argument("--search-url", default="http://127.0.0.1:8000/retrieve", help="the local /retrieve endpoint")
    group.add_argument("--search-topk", type=positive_int, default=3, help="documents per search")
    group.add_argument("--search-concurrency", type=positive_int, default=256, help="searches in flight at once")
    group.add_argument(
        "--generation-concurrency",
        type=positive_int,
        default=256,
        help="engine requests in flight (not held while searching)",
    )
    group.add_argument(
        "--search-timeout",
        type=positive_float,
        default=60.0,
        help="seconds one search request may take (each retry again)",
    )
    group.add_argument(
        "--search-retry-window",
        type=non_negative_float,
        default=30.0,
        help="seconds a failed local search request (network, 5xx, 429, 503) is retried for, with jittered "
        "backoff and the server's Retry-After: long enough for a retriever restart; the last attempt may take "
        "--search-timeout more",
    )
    group.add_argument(
        "--search-retries",
        type=non_negative_int,
        default=None,
        help="at most this many retries of a failed search request (default: local, as many as "
        "--search-retry-window allows; Serper, 3)",
    )
    group.add_argument(
        "--empty-search-text",
        default="No search results are found.",
        help="the observation of a search that found nothing (counted as search_empty); '' gives Search-R1's "
        "empty <information></information>",
    )
    group.add_argument(
        "--search-preflight-timeout",
        type=non_negative_float,
        default=10.0,
        help="seconds the one-query probe of --search-url may take before anything starts (0: no probe)",
    )
    group.add_argument(
        "--engine-timeout",
        type=positive_float,
        default=600.0,
        help="seconds one engine request may take (a turn's decode)",
    )
    group.add_argument(
        "--engine-retries",
        type=non_negative_int,
        default=2,
        help="re-sends of a turn after a transient engine fault",
    )
    group.add_argument(
        "--search-snippet-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Serper: the result snippets as passages (--no-search-snippet-only: text around them from the pages)",
    )
    group.add_argument("--serper-url", default="https://google.serper.dev/search", help="Serper's search endpoint")
    group.add_argument(
        "--serper-cache", default=None, help="SQLite file caching Serper answers across runs and processes"
    )
    group.add_argument(
        "--serper-replay-only",
        action="store_true",
        help="answer Serper searches from --serper-cache only, never calling the API (reproducible evaluation)",
    )
    group.add_argument(
        "--serper-budget-calls",
        type=non_negative_int,
        default=None,
        help="at most this many billed Serper calls over the whole run (cached answers are free)",
    )
    group.add_argument(
        "--serper-budget-usd",
        type=non_negative_float,
        default=None,
        help="at most this many dollars of Serper calls over the run, at --serper-usd-per-call",
    )
    group.add_argument(
        "--serper-usd-per-call",
        type=non_negative_float,
        default=0.001,
        help="what one billed Serper call costs you (default: $1 per 1,000 queries); sets the cost in the report",
    )
    group.add_argument(
        "--serper-at-budget",
        choices=("stop", "replay"),
        default="stop",
        help="at the budget: stop the run with a message, or go on answering from --serper-cache only",
    )
    group.add_argument(
        "--serper-ledger",
        default=None,
        help="SQLite file counting the run's billed Serper calls (default: serper_spend.sqlite in --save); on a local "
        "disk: one on NFS, Lustre, SMB or GPFS is refused, their file locks are not reliable",
    )
    group.add_argument(
        "--tool-format",
        choices=("tags", "qwen3"),
        default="tags",
        help="tags: Search-R1's <search> query </search>; qwen3: Qwen3's native tool calls (tools declared by the "
        "chat template, <tool_call> JSON, tool responses in the template's form); the answer is <answer> in both",
    )
    group.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--tool-format qwen3: let the model think (<think> ... </think>) before it acts (default: off, the "
        "template's empty think block, as torchtitan's and prime-rl's Qwen3 recipes)",
    )
    group.add_argument(
        "--page-access",
        action="store_true",
        help="an <access> url </access> action that reads a whole page from the retriever's /access (ASearcher's "
        "and RLinf's local wiki server; start it with --pages-path); off: Search-R1's loop, unchanged",
    )
    group.add_argument(
        "--access-url", default=None, help="the /access endpoint (default: --search-url with /retrieve -> /access)"
    )
    group.add_argument(
        "--max-page-tokens", type=positive_int, default=1024, help="an accessed page's observation cap, in tokens"
    )
    group.add_argument(
        "--max-turns", type=non_negative_int, default=4, help="search turns before the final answer-only turn"
    )
    group.add_argument(
        "--max-obs-tokens", type=non_negative_int, default=500, help="observation cap per search, in tokens"
    )
    group.add_argument(
        "--max-response-tokens", type=positive_int, default=4096, help="total response budget (all turns)"
    )
    group.add_argument("--no-final-turn", dest="final_turn", action="store_false", help="drop the answer-only turn")
    group.add_argument(
        "--end-on-no-action",
        action="store_true",
        help="a turn ended by EOS or its token limit with neither search nor answer ends the trajectory "
        "(default: Search-R1's invalid-action message and another turn)",
    )
    group.add_argument(
        "--structure-format-score",
        type=float,
        default=0.0,
        help="reward of a well-formed response with a wrong or no answer; a right answer in a malformed one scores 1 "
        "minus it (Search-R1's structure_format_score)",
    )
    group.add_argument(
        "--final-format-score",
        type=float,
        default=0.0,
        help="reward of a malformed response with a wrong answer (Search-R1's final_format_score)",
    )
    group.add_argument(
        "--retrieval-score",
        type=float,
        default=0.0,
        help="added to a well-formed wrong answer when a retrieved passage held the right one (Search-R1's "
        "retrieval_score)",
    )
    group.add_argument(
        "--max-answer-tags", type=positive_int, default=None, help="score 0 above this many <answer> blocks"
    )
    return parser


@dataclass(frozen=True)
class SearchR1Config:
    engine_urls: tuple[str, ...]  # every engine (the trajectories spread over them) or one address (a router)
    tokenizer_path: str
    search_backend: str = "local"
    search_url: str = "http://127.0.0.1:8000/retrieve"
    search_topk: int = 3
    search_concurrency: int = 256
    generation_concurrency: int = 256
    search_timeout: float = 60.0
    search_retry_window: float = 30.0
    search_retries: int | None = None
    empty_search_text: str = "No search results are found."
    engine_timeout: float = 600.0
    engine_retries: int = 2
    search_snippet_only: bool = True
    serper_url: str = "https://google.serper.dev/search"
    serper_cache: str | None = None
    serper_replay_only: bool = False
    serper_budget_calls: int | None = None
    serper_budget_usd: float | None = None
    serper_usd_per_call: float = 0.001
    serper_at_budget: str = "stop"
    serper_ledger: str | None = None
    tool_format: str = "tags"
    enable_thinking: bool = False
    page_access: bool = False
    access_url: str | None = None
    max_page_tokens: int = 1024
    max_turns: int = 4
    max_obs_tokens: int = 500
    max_response_tokens: int = 4096
    final_turn: bool = True
    end_on_no_action: bool = False
    apply_chat_template: bool = False

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
        if self.tool_format not in ("tags", "qwen3"):
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
        address); the tokenizer is the HF checkpoint's; every other field is the flag of the same name."""
        tokenizer_path = getattr(args, "hf_checkpoint", None) or getattr(args, "tokenizer_path", None)
        if not tokenizer_path:
            raise ValueError("no tokenizer: set --hf-checkpoint (an HF folder with the tokenizer)")
        names = [f.name for f in fields(cls) if f.name not in ("engine_urls", "tokenizer_path")]
        settings = flags_from(args, names)
        if not settings["serper_ledger"] and getattr(args, "save", None):
            from slime_search.search_r1.serper_budget import LEDGER_NAME

            settings["serper_ledger"] = str(Path(args.save) / LEDGER_NAME)  # one budget for the run, kept on resume
        return cls(engine_urls=engine_addresses(args), tokenizer_path=str(tokenizer_path), **settings)


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
