"""Whole pages by URL (`/access`, ASearcher's and RLinf's local wiki server), on the real server over 127.0.0.1.

The client calls below send and read exactly what ASearcher's AsyncSearchBrowserClient does (tools/search_utils.py
at 813e804: search posts {"queries": [q], "topk": k, "return_scores": false} and reads each document's "contents"
and "url"; access posts {"urls": [url]} and reads result[0]["contents"], an absent page being null).
"""

import asyncio
import json

import aiohttp
import httpx
import numpy as np
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.pages import PageStore, normalize_page_url
from tests.retriever_helpers import ServerProcess, write_tiny_corpus

pytestmark = pytest.mark.timeout(300)
WIKI = "https://en.wikipedia.org/w/index.php?title="


def write_pages(path, docs) -> None:
    """One page per passage's title, ASearcher's URL form; one URL twice (the later row is the page served)."""
    with open(path, "w") as handle:
        for doc in docs:
            title = doc["contents"].split("\n")[0].strip('"')
            page = {"url": WIKI + title.replace(" ", "%20"), "title": title, "contents": f"{title}\n" + "text " * 50}
            handle.write(json.dumps(page) + "\n")
        handle.write(json.dumps({"url": WIKI + "Red%20Falcon", "contents": "Red Falcon, the later row"}) + "\n")
        handle.write(json.dumps({"title": "no url field", "contents": "left out of the index"}) + "\n")


def test_pages_are_found_by_url_in_either_form_and_the_index_is_kept_beside_the_file(tmp_path):
    docs = write_tiny_corpus(tmp_path / "corpus.jsonl")
    write_pages(tmp_path / "pages.jsonl", docs)
    store = PageStore(tmp_path / "pages.jsonl")
    assert len(store) == 65  # 64 pages + the repeated URL; the row without a url is not indexed
    assert store.get(WIKI + "Blue%20Otter")["title"] == "Blue Otter"
    assert store.get("https://en.wikipedia.org/w/index.php/Blue%20Otter")["title"] == "Blue Otter"
    assert store.get(WIKI + "Red%20Falcon")["contents"] == "Red Falcon, the later row"
    assert store.get(WIKI + "Nowhere") is None
    saved = tmp_path / "pages.jsonl.urls.npy"
    assert saved.is_file() and np.load(saved).dtype == np.int64
    again = PageStore(tmp_path / "pages.jsonl")  # read from the saved index, memory-mapped
    assert isinstance(again.index, np.memmap) and again.get(WIKI + "Blue%20Otter")["title"] == "Blue Otter"
    assert normalize_page_url("https://x/index.php/A") == "https://x/index.php?title=A"


@pytest.fixture(scope="module")
def wiki_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    docs = write_tiny_corpus(root / "plain.jsonl")
    with open(root / "corpus.jsonl", "w") as handle:  # ASearcher's wiki_corpus.jsonl rows carry their page's url
        for doc in docs:
            title = doc["contents"].split("\n")[0].strip('"')
            handle.write(json.dumps({**doc, "url": WIKI + title.replace(" ", "%20")}) + "\n")
    write_pages(root / "pages.jsonl", docs)
    assert build_index.main(["--retriever_name", "bm25", "--corpus_path", str(root / "corpus.jsonl"),
                             "--save_dir", str(root / "idx")]) == 0  # fmt: skip
    with ServerProcess(
        "--index_path",
        str(root / "idx" / "bm25"),
        "--corpus_path",
        str(root / "corpus.jsonl"),
        "--pages_path",
        str(root / "pages.jsonl"),
        "--topk",
        "3",
        "--retriever_name",
        "bm25",
        "--save-address-to",
        str(root / "addresses"),
    ) as server:  # fmt: skip  (ASearcher's and RLinf's flag spellings)
        yield server, root


async def asearcher_style_calls(base: str, query: str, urls: list[str]):
    """Search then access, as ASearcher's client sends and reads them."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        payload = {"queries": [query], "topk": 3, "return_scores": False}
        async with session.post(f"{base}/retrieve", json=payload) as response:
            found = (await response.json())["result"]
        searched = [
            {"documents": [r["contents"] for r in result], "urls": [r["url"] for r in result]} for result in found
        ]
        pages = []
        for url in urls:
            async with session.post(f"{base}/access", json={"urls": [url]}) as response:
                result = (await response.json())["result"][0]
            pages.append(result["contents"] if result is not None else "")
        return searched, pages


def test_asearchers_search_and_access_calls_work_against_this_server(wiki_server):
    server, root = wiki_server
    [searched], pages = asyncio.run(
        asearcher_style_calls(server.url, "green lynx valley", ["placeholder", WIKI + "Nowhere"])
    )
    assert searched["urls"][0] == WIKI + "Green%20Lynx" and searched["documents"][0].startswith('"Green Lynx"')
    [searched_again], pages = asyncio.run(asearcher_style_calls(server.url, "green lynx", [searched["urls"][0]]))
    assert pages == ["Green Lynx\n" + "text " * 50]
    _, missing = asyncio.run(asearcher_style_calls(server.url, "green lynx", [WIKI + "Nowhere"]))
    assert missing == [""]  # an absent page is null, as ASearcher's server answers
    health = httpx.get(f"{server.url}/health").json()
    assert health["pages"] == 65 and health["pages_served"] >= 1 and health["pages_missing"] >= 2
    [address_file] = (root / "addresses").iterdir()
    host, port = server.url.removeprefix("http://").split(":")
    assert address_file.name == f"Host{host}_IP{port}.txt" and address_file.read_text() == f"{host}:{port}"


@pytest.mark.parametrize(
    ("body", "message"),
    [({"urls": []}, 'like {"urls"'), ({"urls": [3]}, "urls[0] is a int"), ({"url": "x"}, 'like {"urls"')],
)
def test_malformed_access_requests_get_400(wiki_server, body, message):
    server, _ = wiki_server
    response = httpx.post(f"{server.url}/access", json=body)
    assert response.status_code == 400 and message in response.json()["detail"]


def test_access_on_a_server_without_pages_says_how_to_give_them(tmp_path):
    write_tiny_corpus(tmp_path / "corpus.jsonl")
    args = ["--retriever-name", "bm25", "--corpus-path", str(tmp_path / "corpus.jsonl"), "--save-dir", str(tmp_path)]
    assert build_index.main(args) == 0
    with ServerProcess(
        "--retriever-name", "bm25", "--index-path", str(tmp_path / "bm25"), "--corpus-path",
        str(tmp_path / "corpus.jsonl"),
    ) as server:  # fmt: skip
        response = httpx.post(f"{server.url}/access", json={"urls": [WIKI + "Red%20Falcon"]})
    assert response.status_code == 404 and "--pages-path" in response.json()["detail"]
