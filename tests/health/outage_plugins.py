"""Generate and reward plugins for the tests of faults that pass (loaded by dotted path, in the rollout manager): no
model, but real calls to a real retriever and a real reward service on 127.0.0.1, through the real search client and
aiohttp, so that what fails is what fails in a run (a connection refused, an HTTP 503)."""

from __future__ import annotations

import aiohttp

from slime_search.search_r1.search_clients import LocalSearchClient, LocalSearchConfig
from slime_search.search_r1.search_error import SearchError
from slime_search.types import Sample, Status

PROMPT_BASE = 1000  # a sample's first prompt token: PROMPT_BASE + its row in the prompt file (what the trainer saw)
RESPONSE = [5, 6, 7, 8]


def row_of(tokens: list[int]) -> int:
    return tokens[0] - PROMPT_BASE


async def search_once(args, sample: Sample, sampling_params: dict) -> Sample:
    """One search of `args.search_url` for the prompt, then a fixed answer; a failed search fails the trajectory as
    Search-R1's generate does (`finish_reason` search_error, the retriever's address in the error). No retry: the
    retriever is up or down at the moment of the search."""
    row = int(sample.metadata["index"])
    sample.tokens = [PROMPT_BASE + row, 1, 2]
    client = LocalSearchClient(LocalSearchConfig(url=args.search_url, timeout_s=5.0, retry_window_s=0.0, retries=0))
    try:
        question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
        docs = await client.search(question)
    except SearchError as err:
        sample.status = Status.FAILED
        sample.metadata.update(finish_reason="search_error", error=f"{args.search_url}: {err}")
        return sample
    finally:
        await client.close()
    sample.metrics.update(searches=1, search_latency_s=0.0)
    found = docs[0].get("document", docs[0])["contents"]  # with scores, the document sits under "document"
    sample.append_response_tokens(RESPONSE, generated=True, log_probs=[-1.0] * len(RESPONSE), text=found)
    sample.response = found
    sample.status = Status.COMPLETED
    sample.metadata["finish_reason"] = "answer"
    return sample


async def answer_only(args, sample: Sample, sampling_params: dict) -> Sample:
    """A fixed answer without a search (the reward's faults alone)."""
    row = int(sample.metadata["index"])
    sample.tokens = [PROMPT_BASE + row, 1, 2]
    sample.append_response_tokens(RESPONSE, generated=True, log_probs=[-1.0] * len(RESPONSE), text="valley")
    sample.response, sample.status = "valley", Status.COMPLETED
    return sample


async def service_reward(args, sample: Sample, **kwargs) -> float:
    """The score of a reward service at `args.reward_url` (a judge endpoint's shape): its faults raise as aiohttp
    raises them (ClientConnectorError when it is down, ClientResponseError 503 when it is overloaded)."""
    body = {"response": sample.response, "index": sample.index}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.post(args.reward_url, json=body) as answer,
    ):
        answer.raise_for_status()
        return float((await answer.json())["score"])


async def alternating_reward(args, sample: Sample, **kwargs) -> float:
    """1 for every other sample: each group has reward signal."""
    return float(sample.index % 2)


async def buggy_reward(args, sample: Sample, **kwargs) -> float:
    """A reward plugin with a bug: a key its label never has (a retry meets it again)."""
    return float(sample.label["no such key"])
