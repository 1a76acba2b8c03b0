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
from tests.search_r1.conftest import SERPER_KEY

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


def test_one_blank_query_among_concurrent_searches_fails_none_of_them(bm25_server):
    """Search-R1 passes a blank query through and the trajectory goes on: the real server answers it with no
    documents, and the coalesced batch it rode in is answered for every query."""

    async def run():
        client = LocalSearchClient(LocalSearchConfig(url=f"{bm25_server.url}/retrieve", window_ms=50))
        try:
            return await asyncio.gather(*(client.search(q) for q in ["red walrus", " ", "blue walrus", ""]))
        finally:
            await client.close()

    red, blank, blue, empty = asyncio.run(run())
    assert blank == [] and empty == []
    assert red[0]["document"]["contents"].startswith('"Red Walrus"')
    assert blue[0]["document"]["contents"].startswith('"Blue Walrus"')


def search_all(url: str, queries: list[str], **config) -> list:
    """Every query searched concurrently through one client: its documents, or the exception it ended with."""

    async def run():
        client = LocalSearchClient(LocalSearchConfig(url=url, window_ms=50, backoff_base_s=0.01, **config))
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(client.search(q) for q in queries), return_exceptions=True), timeout=60
            )
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("fault", ["garbled", "no-result", "null-result"])
def test_a_malformed_200_answer_resolves_every_waiting_search(serper, fault):
    """The batch's answer is unusable, so each of its searches fails, with the reason; none is left waiting."""
    queries = [f"question {i}" for i in range(62)] + [fault]
    outcomes = search_all(f"{serper.url}/retrieve", queries)
    assert len(outcomes) == 63 and all(isinstance(o, SearchError) for o in outcomes)
    assert "not JSON" in str(outcomes[0]) if fault == "garbled" else "for 63 queries" in str(outcomes[0])


def test_only_the_query_with_malformed_documents_fails(serper):
    outcomes = search_all(f"{serper.url}/retrieve", ["first", "no-contents", "third"])
    assert outcomes[0][0]["document"]["contents"] == '"first"\nabout first'
    assert isinstance(outcomes[1], SearchError) and "without 'contents'" in str(outcomes[1])
    assert outcomes[2][0]["document"]["contents"] == '"third"\nabout third'


def test_a_refused_batch_is_resent_query_by_query_and_only_the_refused_one_fails(serper):
    before = len(httpx.get(f"{serper.url}/health").json()["retrieve_requests"])
    outcomes = search_all(f"{serper.url}/retrieve", ["first", "refuse", "third"])
    assert isinstance(outcomes[0], list) and isinstance(outcomes[1], SearchError) and isinstance(outcomes[2], list)
    assert "rejected the request: HTTP 400" in str(outcomes[1])
    sizes = httpx.get(f"{serper.url}/health").json()["retrieve_requests"][before:]
    assert sizes == [3, 1, 1, 1]  # the batch, then each query alone; a refusal is not retried


def test_a_search_that_gets_no_answer_fails_at_its_deadline():
    """A server that accepts the connection and never answers: the search ends with a SearchError in bounded time."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/retrieve"
        config = {"timeout_s": 0.2, "retry_window_s": 0.5, "backoff_cap_s": 0.05}
        assert LocalSearchConfig(url, **config).deadline_s < 3
        (outcome,) = search_all(url, ["anything"], **config)
    assert isinstance(outcome, SearchError)


KEY = SERPER_KEY  # the key the shared stand-in accepts (conftest.py)


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


def test_serper_never_follows_a_redirect_with_the_key(monkeypatch, serper):
    monkeypatch.setenv("SERPER_API_KEY", KEY)

    async def run():
        client = SerperClient(serper_config(serper))
        try:
            await client.search("redirect")
        finally:
            await client.close()

    with pytest.raises(SearchError, match="redirect"):
        asyncio.run(run())
    assert httpx.get(f"{serper.url}/captured").json() == []  # the other origin never saw a request, let alone the key


def test_serper_garbled_or_odd_answers_become_search_errors_or_clean_documents(monkeypatch, serper):
    monkeypatch.setenv("SERPER_API_KEY", KEY)

    async def run(query):
        client = SerperClient(serper_config(serper, retries=1))
        try:
            return await client.search(query)
        finally:
            await client.close()

    with pytest.raises(SearchError, match="not JSON"):
        asyncio.run(run("garbled"))
    docs = asyncio.run(run("odd"))
    assert [d["contents"] for d in docs] == ['"No title."\nNo snippet available.', '"Fine"\nkept as it is']


def test_html_to_text_and_page_context():
    page = "<html><head><title>T</title></head><body><script>bad()</script><p>First  para.</p><p>Second para here.</p></body></html>"
    assert html_to_text(page) == "First para.\nSecond para here."
    text = "intro\nthe quick brown fox jumps over the lazy dog today\noutro"
    assert (
        page_context("x ... quick brown fox jumps over the lazy ... y", text)
        == "the quick brown fox jumps over the lazy dog today"
    )
    assert page_context("no match here at all in this page text", text) == "no match here at all in this page text"


def test_a_server_process_removes_only_the_log_it_created(tmp_path):
    argv = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", KEY]
    with ServerProcess(argv) as own:
        own_log = own.log_path
        assert own_log.is_file()
    assert not own_log.exists()  # a temporary log of its own making does not litter /tmp
    with ServerProcess(argv, log_path=tmp_path / "server.log") as given:
        pass
    assert given.log_path.is_file()  # a log the caller asked for stays
