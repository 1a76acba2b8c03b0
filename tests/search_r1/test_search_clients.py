"""Search clients against real local servers: the retrieval server (BM25) and a Serper stand-in."""

import asyncio
import logging

import httpx
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.search_clients import (
    LocalSearchClient,
    LocalSearchConfig,
    SearchError,
    SerperClient,
    SerperConfig,
    format_observation,
    html_to_text,
    page_context,
)
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(300)


def test_format_observation_is_search_r1s():
    docs = [{"document": {"contents": '"Red Otter"\nThe red otter lives here.'}}, {"contents": "Title only"}]
    assert (
        format_observation(docs) == 'Doc 1(Title: "Red Otter") The red otter lives here.\nDoc 2(Title: Title only) \n'
    )


@pytest.fixture(scope="module")
def bm25_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bm25")
    write_tiny_corpus(root / "corpus.jsonl")
    assert (
        build_index.main(
            ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
        )
        == 0
    )
    with RetrievalServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl")
    ) as server:
        yield server


def test_local_client_coalesces_concurrent_queries(bm25_server):
    queries = [f"{c} walrus" for c in ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black"]] * 5

    async def run():
        client = LocalSearchClient(LocalSearchConfig(url=f"{bm25_server.url}/retrieve", topk=2, window_ms=20))
        try:
            results = await asyncio.gather(*(client.search(q) for q in queries))
        finally:
            await client.close()
        return results, client

    results, client = asyncio.run(run())
    assert client.queries_sent == 40 and client.requests_sent <= 2
    assert client.batching_factor >= 20
    direct = httpx.post(
        f"{bm25_server.url}/retrieve", json={"queries": queries[:8], "topk": 2, "return_scores": True}
    ).json()
    assert results[:8] == direct["result"]
    assert results[0][0]["document"]["contents"].startswith('"Red Walrus"')


def test_local_client_raises_typed_error_when_unreachable():
    config = LocalSearchConfig(url="http://127.0.0.1:9/retrieve", retries=2, backoff_base_s=0.01, timeout_s=2)

    async def run():
        client = LocalSearchClient(config)
        try:
            await client.search("anything")
        finally:
            await client.close()

    with pytest.raises(SearchError, match="after 3 attempts"):
        asyncio.run(run())


def test_local_client_does_not_retry_a_rejected_request(bm25_server):
    async def run():
        client = LocalSearchClient(LocalSearchConfig(url=f"{bm25_server.url}/retrieve", backoff_base_s=0.01))
        try:
            await client.search("   ")  # the server answers 400: an empty query
        finally:
            await client.close()
        return client

    with pytest.raises(SearchError, match="rejected the request: HTTP 400"):
        asyncio.run(run())


KEY = "test-secret-key-123"


@pytest.fixture(scope="module")
def serper():
    with ServerProcess(
        [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", KEY]
    ) as server:
        yield server


def serper_config(server, **overrides):
    return SerperConfig(endpoint=f"{server.url}/search", backoff_base_s=0.01, page_timeout_s=1.0, **overrides)


def test_serper_requires_key(monkeypatch, serper):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    with pytest.raises(SearchError, match="SERPER_API_KEY"):
        SerperClient(serper_config(serper))


def test_serper_snippet_mode(monkeypatch, serper):
    monkeypatch.setenv("SERPER_API_KEY", KEY)

    async def run():
        client = SerperClient(serper_config(serper, topk=3))
        try:
            return await client.search("cafe  de flore"), await client.search("cafe de flore")
        finally:
            await client.close()

    first, cached = asyncio.run(run())
    assert first == cached
    assert [d["contents"].split("\n")[0] for d in first] == ['"Café de Flore"', '"No link here"', '"Eiffel Tower"']
    assert first[1]["contents"].endswith("An item without a link must keep its own snippet text in place.")
    calls = httpx.get(f"{serper.url}/health").json()["calls"]
    assert calls["cafe de flore"] == 1  # the second search came from the cache


def test_serper_full_page_mode_keeps_pages_aligned_and_decodes(monkeypatch, serper):
    monkeypatch.setenv("SERPER_API_KEY", KEY)

    async def run():
        client = SerperClient(serper_config(serper, topk=4, snippet_only=False))
        try:
            return await client.search("paris landmarks")
        finally:
            await client.close()

    docs = asyncio.run(run())
    # latin-1 page without a declared charset: chardet must decode it (é intact), and the paragraph is found
    assert "Le café de Flore est un café parisien très célèbre" in docs[0]["contents"]
    # the item without a link keeps its own snippet (no page shifted into its place)
    assert "An item without a link" in docs[1]["contents"]
    assert "The Eiffel Tower was completed in 1889" in docs[2]["contents"] and "var x" not in docs[2]["contents"]
    # the slow page timed out: the snippet stands in for it
    assert "never loads in time" in docs[3]["contents"]


def test_serper_honours_retry_after_and_hides_the_key(monkeypatch, serper, caplog):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    caplog.set_level(logging.DEBUG)

    async def run():
        client = SerperClient(serper_config(serper))
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            docs = await client.search("busy")
            return docs, loop.time() - start
        finally:
            await client.close()

    docs, elapsed = asyncio.run(run())
    assert docs and elapsed >= 1.0  # waited out Retry-After: 1 before the second, successful call
    monkeypatch.setenv("SERPER_API_KEY", "wrong-key")

    async def unauthorized():
        client = SerperClient(serper_config(serper))
        try:
            await client.search("x")
        finally:
            await client.close()

    with pytest.raises(SearchError) as info:
        asyncio.run(unauthorized())
    assert "wrong-key" not in str(info.value) and KEY not in caplog.text


def test_html_to_text_and_page_context():
    page = "<html><head><title>T</title></head><body><script>bad()</script><p>First  para.</p><p>Second para here.</p></body></html>"
    assert html_to_text(page) == "First para.\nSecond para here."
    text = "intro\nthe quick brown fox jumps over the lazy dog today\noutro"
    assert (
        page_context("x ... quick brown fox jumps over the lazy ... y", text)
        == "the quick brown fox jumps over the lazy dog today"
    )
    assert page_context("no match here at all in this page text", text) == "no match here at all in this page text"
