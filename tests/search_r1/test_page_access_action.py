"""The optional <access> url </access> action (--page-access) through the real loop: a scripted engine, the real
retriever serving pages on 127.0.0.1. Off by default, where Search-R1's loop is unchanged."""

import asyncio
import json

import httpx
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.rollout.sample_metrics import rollout_metrics
from slime_search.search_r1.config import SearchR1Config, search_r1_args
from slime_search.search_r1.generate import INVALID_ACTION, PAGE_NOT_FOUND, close_resources, generate, parse_action
from slime_search.search_r1.prompt import make_prompt
from slime_search.types import Sample, Status
from slime_search.utils.server_process import ServerProcess
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(300)
WIKI = "https://en.wikipedia.org/w/index.php?title="
PAGE_TEXT = "Red Falcon\n" + "The red falcon nests in valley number 0 and hunts at dawn. " * 40
SCRIPT = {
    "red falcon": [
        "<think> search first </think>\n<search> red falcon </search>",
        f"<think> read its page </think>\n<access> {WIKI}Red%20Falcon </access>",
        "<think> the page says valley 0 </think>\n<answer> valley 0 </answer>",
    ],
    "blue otter": [
        f"<access> {WIKI}Nowhere </access>",
        "<answer> valley 9 </answer>",
    ],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("access")
    docs = write_tiny_corpus(root / "plain.jsonl")
    with open(root / "corpus.jsonl", "w") as corpus, open(root / "pages.jsonl", "w") as pages:
        for doc in docs:
            title = doc["contents"].split("\n")[0].strip('"')
            url = WIKI + title.replace(" ", "%20")
            corpus.write(json.dumps({**doc, "url": url}) + "\n")
            text = PAGE_TEXT if title == "Red Falcon" else f"{title}\nA short page."
            pages.write(json.dumps({"url": url, "contents": text}) + "\n")
    args = ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main(args) == 0
    (root / "script.json").write_text(json.dumps(SCRIPT))
    engine = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_checkpoint), "--script",
              str(root / "script.json"), "--port", "0"]  # fmt: skip
    with (
        RetrievalServerProcess(
            "--retriever-name",
            "bm25",
            "--index-path",
            str(root / "bm25"),
            "--corpus-path",
            str(root / "corpus.jsonl"),
            "--pages-path",
            str(root / "pages.jsonl"),
            "--topk",
            "1",
        ) as retriever,  # fmt: skip
        ServerProcess(engine) as engine_server,
    ):
        yield retriever, engine_server


def run(servers, tiny_checkpoint, question, **flags):
    retriever, engine = servers
    args = search_r1_args(
        engine_url=engine.url, hf_checkpoint=str(tiny_checkpoint), search_url=f"{retriever.url}/retrieve",
        apply_chat_template=True, search_topk=1, **flags,
    )  # fmt: skip
    sample = Sample(prompt=make_prompt(question, "access"), label={"target": ["valley 0"]})

    async def go():
        try:
            return await generate(args, sample, {"temperature": 1.0, "max_new_tokens": 200})
        finally:
            await close_resources()

    return asyncio.run(go())


def test_a_page_is_read_cut_to_its_budget_and_counted_per_tool(servers, tiny_checkpoint):
    sample = run(servers, tiny_checkpoint, "Where does the red falcon live", page_access=True, max_page_tokens=64)
    assert sample.status is Status.COMPLETED and sample.metadata["finish_reason"] == "answer"
    assert sample.metrics["searches"] == 1 and sample.metrics["accesses"] == 1
    assert sample.metrics["access_missing"] == 0 and sample.metrics["obs_truncations"] == 1  # the page, cut
    assert f'(Title: "Red Falcon")[{WIKI}Red%20Falcon]' in sample.response  # the search names the page
    page_block = sample.response.split(f"<access> {WIKI}Red%20Falcon </access>")[1].split("</information>")[0]
    assert "The red falcon nests in valley number 0" in page_block and len(page_block) < len(PAGE_TEXT) / 3
    metrics = rollout_metrics([sample])
    assert metrics["rollout/accesses_mean"] == 1.0 and metrics["rollout/search_calls"] == 2.0


def test_a_page_the_server_does_not_hold_reads_as_not_found(servers, tiny_checkpoint):
    sample = run(servers, tiny_checkpoint, "Where does the blue otter live", page_access=True)
    assert sample.metrics["accesses"] == 1 and sample.metrics["access_missing"] == 1
    assert f"<information>{PAGE_NOT_FOUND}</information>" in sample.response
    assert sample.metadata["finish_reason"] == "answer"


def test_without_page_access_the_loop_is_search_r1s(servers, tiny_checkpoint):
    sample = run(servers, tiny_checkpoint, "Where does the blue otter live")
    assert sample.metrics["accesses"] == 0 and sample.metrics["invalid_actions"] == 1
    assert INVALID_ACTION in sample.response and "<information>" not in sample.response
    assert parse_action("<access> u </access>") == (None, "")
    assert parse_action("<access> u </access>", ("search", "answer", "access")) == ("access", "u")


def test_page_access_is_refused_with_web_search_and_its_url_follows_the_retrievers():
    config = dict(engine_urls=("http://e",), tokenizer_path="t", page_access=True)
    assert SearchR1Config(**config, search_url="http://r:8000/retrieve").page_access_url == "http://r:8000/access"
    assert SearchR1Config(**config, access_url="http://p/access").page_access_url == "http://p/access"
    with pytest.raises(ValueError, match="--page-access reads pages from the local retriever"):
        SearchR1Config(**config, search_backend="serper")


def tool_call(name: str, argument: str, value: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"{argument}": "{value}"}}}}\n</tool_call>'


NATIVE_SCRIPT = {
    "red falcon": [
        tool_call("search", "query", "red falcon"),
        tool_call("access", "url", f"{WIKI}Red%20Falcon"),
        "The page says valley 0.\n<answer> valley 0 </answer>",
    ],
    "blue otter": [tool_call("access", "url", f"{WIKI}Nowhere"), "<answer> valley 9 </answer>"],
}


def test_with_qwen3s_tool_calls_a_page_is_read_through_the_access_tool(servers, tiny_qwen3_checkpoint, tmp_path):
    """--tool-format qwen3 --page-access: the access tool is declared in the system turn, its call reads the page as
    a tool response cut to its budget, a page the server lacks reads as not found; every request is token-exact."""
    from transformers import AutoTokenizer

    from slime_search.search_r1.tool_format import ACCESS_TOOL
    from tests.search_r1.test_native_tool_format import check_token_exact

    retriever, _ = servers
    (tmp_path / "script.json").write_text(json.dumps(NATIVE_SCRIPT))
    engine_argv = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_qwen3_checkpoint), "--script",
                   str(tmp_path / "script.json"), "--port", "0"]  # fmt: skip
    with ServerProcess(engine_argv) as engine:
        args = search_r1_args(
            engine_url=engine.url, hf_checkpoint=str(tiny_qwen3_checkpoint), search_url=f"{retriever.url}/retrieve",
            tool_format="qwen3", search_topk=1, max_turns=3, page_access=True, max_page_tokens=64,
        )  # fmt: skip

        async def go():
            try:
                samples = [
                    Sample(
                        prompt=[{"role": "user", "content": make_prompt(q, "native")}], label={"target": ["valley 0"]}
                    )
                    for q in ("where does the red falcon live", "where does the blue otter live")
                ]
                return await asyncio.gather(
                    *(generate(args, s, {"temperature": 1.0, "max_new_tokens": 96}) for s in samples)
                )
            finally:
                await close_resources()

        read, missing = asyncio.run(go())
        requests = httpx.get(f"{engine.url}/requests").json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_checkpoint)
    prompt = tokenizer.decode(read.tokens[: len(read.tokens) - read.response_length])
    assert json.dumps(ACCESS_TOOL) in prompt  # declared beside the search tool
    assert read.status is Status.COMPLETED and read.metadata["finish_reason"] == "answer"
    assert read.metrics["searches"] == 1 and read.metrics["accesses"] == 1 and read.metrics["access_missing"] == 0
    text = tokenizer.decode(read.response_tokens)
    page = text.split(f"{WIKI}Red%20Falcon")[-1].split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert "The red falcon nests in valley number 0" in page and len(page) < len(PAGE_TEXT) / 3  # cut to 64 tokens
    assert read.metrics["obs_truncations"] == 1
    assert missing.metrics["access_missing"] == 1 and f"<tool_response>\n{PAGE_NOT_FOUND}\n</tool_response>" in (
        tokenizer.decode(missing.response_tokens)
    )
    for sample in (read, missing):
        check_token_exact(sample, requests, tokenizer)
