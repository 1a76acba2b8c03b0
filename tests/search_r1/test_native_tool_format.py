"""--tool-format qwen3 through the real loop: a scripted engine speaking Qwen3's tokenizer and the real BM25
retriever on 127.0.0.1. Every engine request is checked token by token: prompt + everything generated + the
template's rendering of each observation, never a re-tokenisation."""

import asyncio
import json
import random

import httpx
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import close_resources, generate
from slime_search.search_r1.prompt import make_prompt
from slime_search.search_r1.reward import reward_func
from slime_search.search_r1.tool_format import SEARCH_TOOL, parse_tool_call, tool_response_text
from slime_search.types import Sample, Status
from slime_search.utils.server_process import ServerProcess
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(600)


def call(query: str) -> str:
    return f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{query}"}}}}\n</tool_call>'


SCRIPT = {
    "red falcon": [call("red falcon"), "The passage says so.\n<answer> valley 0 </answer>"],
    "blue otter": ["<tool_call>\n{not json}\n</tool_call>", "<answer> valley 9 </answer>"],
    "green lynx": ["I will just answer.<|im_end|>", "<answer> valley 18 </answer>"],
    "pink crab": ['<tool_call>\n{"name": "browse", "arguments": {}}\n</tool_call>', "<answer> x </answer>"],
}
CASES = ["red falcon", "blue otter", "green lynx", "pink crab"]


def random_script(rng: random.Random, question: str) -> list[str]:
    """A random transcript: searches (some with thinking), malformed calls, turns without an action, an answer."""
    turns = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["search", "search", "think-search", "malformed", "no-action"])
        if kind == "search":
            turns.append(call(rng.choice(["red falcon", "green lynx valley", "who eats otter food"])))
        elif kind == "think-search":
            turns.append("<think>\nlet me look\n</think>\n\n" + call("blue heron"))
        elif kind == "malformed":
            turns.append('<tool_call>\n{"name": "search", "arguments": {"q": 1}}\n</tool_call>')
        else:
            turns.append("hmm, not sure<|im_end|>")
    turns.append(rng.choice(["<answer> valley 3 </answer>", "done <answer> x </answer>", "rambling " * 30]))
    return turns


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_qwen3_checkpoint):
    root = tmp_path_factory.mktemp("native")
    write_tiny_corpus(root / "corpus.jsonl")
    args = ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main(args) == 0
    rng = random.Random(0)
    script = dict(SCRIPT) | {f"question {i:04d}": random_script(rng, f"q{i}") for i in range(1000)}
    (root / "script.json").write_text(json.dumps(script))
    engine = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_qwen3_checkpoint), "--script",
              str(root / "script.json"), "--port", "0"]  # fmt: skip
    with (
        RetrievalServerProcess(
            "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl")
        ) as retriever,
        ServerProcess(engine) as engine_server,
    ):
        yield retriever, engine_server


def run_all(servers, checkpoint, questions, **flags):
    retriever, engine = servers
    args = search_r1_args(
        engine_url=engine.url, hf_checkpoint=str(checkpoint), search_url=f"{retriever.url}/retrieve",
        tool_format="qwen3", search_topk=1, max_obs_tokens=120, max_turns=3, **flags,
    )  # fmt: skip

    async def go():
        try:
            samples = [
                Sample(prompt=[{"role": "user", "content": make_prompt(q, "native")}], label={"target": ["valley 0"]})
                for q in questions
            ]
            params = {"temperature": 1.0, "max_new_tokens": 64}
            return await asyncio.gather(*(generate(args, s, params) for s in samples))
        finally:
            await close_resources()

    before = len(httpx.get(f"{engine.url}/requests").json())
    samples = asyncio.run(go())
    return samples, httpx.get(f"{engine.url}/requests").json()[before:]


def check_token_exact(sample, requests, tokenizer, thinking: bool = False) -> int:
    """Every request of this sample's trajectory: its input_ids are the prompt + the response ids up to that turn,
    and each observation span is a whole template rendering of a tool response or a user message."""
    prompt_len = len(sample.tokens) - sample.response_length
    stream = sample.tokens
    mine = [r["input_ids"] for r in requests if r["input_ids"][:prompt_len] == stream[:prompt_len]]
    assert mine, "no request of this trajectory"
    for ids in mine:
        assert ids == stream[: len(ids)]  # a prefix of the final stream: nothing re-tokenised, nothing rewritten
    mask = sample.loss_mask
    spans, start = [], None
    for i, m in enumerate([*mask, 1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            spans.append(tokenizer.decode(sample.response_tokens[start:i]))
            start = None
    for span in spans:
        assert span.removeprefix("<|im_end|>").startswith("\n<|im_start|>user\n"), span[:60]
        ending = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
        assert span.endswith(ending), span[-60:]
    return len(mine)


def test_a_search_by_native_tool_call_and_the_template_form_of_its_response(servers, tiny_qwen3_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_checkpoint)
    samples, requests = run_all(servers, tiny_qwen3_checkpoint, [f"where does the {c} live" for c in CASES])
    found, malformed, no_action, unknown = samples
    prompt = tokenizer.decode(found.tokens[: len(found.tokens) - found.response_length])
    assert json.dumps(SEARCH_TOOL) in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert found.status is Status.COMPLETED and found.metrics["searches"] == 1
    assert found.metadata["finish_reason"] == "answer"
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1(Title: " in tokenizer.decode(
        found.response_tokens
    )
    assert asyncio.run(reward_func(search_r1_args(), found))["score"] == 1.0  # the answer is read as today
    assert malformed.metrics["invalid_actions"] == 1 and "Error: the tool call is not valid JSON" in malformed.response
    assert no_action.metrics["invalid_actions"] == 1 and "had no tool call and no answer" in no_action.response
    assert "there is no tool named 'browse'" in unknown.response
    for sample in samples:
        check_token_exact(sample, requests, tokenizer)


def test_a_thousand_random_transcripts_are_token_exact(servers, tiny_qwen3_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_checkpoint)
    samples, requests = run_all(servers, tiny_qwen3_checkpoint, [f"question {i:04d}" for i in range(1000)])
    checked = sum(check_token_exact(sample, requests, tokenizer) for sample in samples)
    assert checked == len(requests) and checked >= 2000
    finishes = {s.metadata["finish_reason"] for s in samples}
    assert {"answer", "final_turn"} <= finishes or {"answer", "length"} <= finishes


def test_with_thinking_on_the_template_opens_no_empty_think_block(servers, tiny_qwen3_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_checkpoint)
    questions = [f"question {i:04d}" for i in range(20)]
    samples, requests = run_all(servers, tiny_qwen3_checkpoint, questions, enable_thinking=True)
    assert sum(check_token_exact(s, requests, tokenizer, thinking=True) for s in samples) == len(requests)
    prompt = tokenizer.decode(samples[0].tokens[: len(samples[0].tokens) - samples[0].response_length])
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_calls_parse_or_say_why_not():
    assert parse_tool_call('{"name": "search", "arguments": {"query": " q "}}', False) == ("search", "q")
    assert parse_tool_call('{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}', False) == ("search", "q")
    assert parse_tool_call('{"name": "access", "arguments": {"url": "u"}}', True) == ("access", "u")
    assert parse_tool_call('{"name": "access", "arguments": {"url": "u"}}', False)[0] is None
    assert parse_tool_call("[" * 100_000, False)[0] is None  # nesting too deep: an invalid action, not a crash
    assert "needs" in parse_tool_call('{"name": "search", "arguments": {}}', False)[1]
    assert (
        tool_response_text("B", True, True)
        == "\n<|im_start|>user\n<tool_response>\nB\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
