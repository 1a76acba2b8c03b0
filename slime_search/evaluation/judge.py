"""An optional LLM judge for the answers exact match misses ("the 44th president" for "Barack Obama"). It is any
OpenAI-compatible chat endpoint, asked once per distinct (question, answer, references) and model. Every verdict is
cached in SQLite, so a re-run or another run asks again only what is new. The tokens (and dollars, at the prices given)
of what it did ask are logged.

Only answers EM scored 0 are sent; an answer EM accepts is accepted without asking. A call that still fails after
its retries leaves that answer unjudged (counted and reported), never silently "no". The key comes from the
environment (`--judge-api-key-env`, OPENAI_API_KEY by default), never from a flag or a file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM = (
    "You grade answers to trivia questions. Given the question, the reference answers and a candidate answer, reply "
    "with one word: yes if the candidate means the same entity or fact as one of the references, no otherwise."
)
RETRIES = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    key TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    reply TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    created REAL NOT NULL
)
"""


@dataclass(frozen=True)
class JudgeConfig:
    url: str  # the endpoint's base, e.g. https://api.openai.com/v1 (…/chat/completions is appended)
    model: str
    cache_path: str
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout_s: float = 60.0
    usd_per_million_input: float = 0.0
    usd_per_million_output: float = 0.0


@dataclass
class JudgeLedger:
    """What the judging cost and what it could not do."""

    asked: int = 0
    cached: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def usd(self, config: JudgeConfig) -> float:
        return (
            self.input_tokens * config.usd_per_million_input + self.output_tokens * config.usd_per_million_output
        ) / 1e6

    def as_dict(self, config: JudgeConfig) -> dict:
        return {
            "judge_asked": self.asked,
            "judge_cached": self.cached,
            "judge_failed": self.failed,
            "judge_input_tokens": self.input_tokens,
            "judge_output_tokens": self.output_tokens,
            "judge_cost_usd": self.usd(config),
        }


def judge_prompt(question: str, answer: str, references: list[str]) -> str:
    refs = "; ".join(references)
    return f"Question: {question}\nReference answers: {refs}\nCandidate answer: {answer}\nSame answer (yes/no)?"


def parse_verdict(reply: str) -> bool:
    """yes -> True, no -> False; anything else is an error (a judge that does not answer the question asked)."""
    word = reply.strip().strip(".!").split()[0].lower() if reply.strip() else ""
    if word in ("yes", "no"):
        return word == "yes"
    raise ValueError(f"the judge replied {reply[:80]!r}, not yes or no")


class VerdictCache:
    def __init__(self, path: str | Path):
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    @staticmethod
    def key(model: str, prompt: str) -> str:
        return hashlib.sha256(f"{model}\n{SYSTEM}\n{prompt}".encode()).hexdigest()

    def get(self, model: str, prompt: str) -> bool | None:
        with self._connect() as db:
            row = db.execute("SELECT accepted FROM verdicts WHERE key = ?", (self.key(model, prompt),)).fetchone()
        return None if row is None else bool(row[0])

    def put(self, model: str, prompt: str, reply: str, accepted: bool) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?, ?)",
                (self.key(model, prompt), model, prompt, reply, int(accepted), time.time()),
            )


async def _ask(client, config: JudgeConfig, prompt: str, ledger: JudgeLedger) -> tuple[str, bool]:
    """One chat completion, retried on transport errors, 429 and 5xx; the reply and its verdict."""
    import httpx

    body = {
        "model": config.model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 4,
    }
    last = ""
    for attempt in range(RETRIES):
        try:
            response = await client.post(f"{config.url.rstrip('/')}/chat/completions", json=body)
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        else:
            if response.status_code == 200:
                answer = response.json()
                usage = answer.get("usage") or {}
                ledger.input_tokens += int(usage.get("prompt_tokens", 0))
                ledger.output_tokens += int(usage.get("completion_tokens", 0))
                reply = answer["choices"][0]["message"]["content"] or ""
                return reply, parse_verdict(reply)
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code not in (429,) and response.status_code < 500:
                break  # a request the endpoint refuses (bad key, unknown model) is refused again
        if attempt + 1 < RETRIES:
            await asyncio.sleep(0.5 * 2**attempt)
    raise RuntimeError(last)


async def judge_all(
    items: list[tuple[str, str, list[str]]], config: JudgeConfig
) -> tuple[list[bool | None], JudgeLedger]:
    """A verdict per (question, answer, references): True / False, or None where the judge could not be asked."""
    import httpx

    key = os.environ.get(config.api_key_env, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    cache, ledger = VerdictCache(config.cache_path), JudgeLedger()
    prompts = [judge_prompt(*item) for item in items]
    verdicts: dict[str, bool | None] = {}
    for prompt in dict.fromkeys(prompts):
        cached = cache.get(config.model, prompt)
        if cached is not None:
            verdicts[prompt] = cached
            ledger.cached += 1
    gate = asyncio.Semaphore(config.concurrency)

    async def one(client, prompt: str) -> None:
        async with gate:
            try:
                reply, accepted = await _ask(client, config, prompt, ledger)
            except (RuntimeError, ValueError, KeyError, IndexError) as err:
                ledger.failed += 1
                ledger.errors.append(str(err))
                verdicts[prompt] = None
                return
            ledger.asked += 1
            cache.put(config.model, prompt, reply, accepted)
            verdicts[prompt] = accepted

    asking = [p for p in dict.fromkeys(prompts) if p not in verdicts]
    async with httpx.AsyncClient(headers=headers, timeout=config.timeout_s) as client:
        await asyncio.gather(*(one(client, p) for p in asking))
    return [verdicts[p] for p in prompts], ledger


def judge_rows(rows: list[dict], items: list[tuple[str, str, list[str]] | None], config: JudgeConfig) -> JudgeLedger:
    """Add "judge" (1.0 accepted, 0.0 not, None unjudged) to each graded row: an EM of 1 is accepted without asking,
    a row with no answer (`items[i]` None) is not accepted; the others go to the judge."""
    asked = [i for i, (row, item) in enumerate(zip(rows, items, strict=True)) if row["em"] < 1 and item is not None]
    verdicts, ledger = asyncio.run(judge_all([items[i] for i in asked], config)) if asked else ([], JudgeLedger())
    for row in rows:
        row["judge"] = 1.0 if row["em"] >= 1 else 0.0
    for i, verdict in zip(asked, verdicts, strict=True):
        rows[i]["judge"] = None if verdict is None else float(verdict)
    return ledger


def question_of(prompt) -> str:
    """The question in a rendered prompt (after its last "Question:"), or the whole prompt."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return text.rpartition("Question:")[2].split("<|im_end|>")[0].strip() or text
