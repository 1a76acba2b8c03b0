"""The real retrieval server over 127.0.0.1: Search-R1 API compatibility, batching, cache, validation, BM25."""

import asyncio
import json
import os

import aiohttp
import httpx
import numpy as np
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.encoder import Encoder, EncoderConfig
from local_dense_retriever.index import DenseRetriever, encoder_config_from_meta, read_meta
from tests.retriever_helpers import ServerProcess, minilm_path, write_tiny_corpus

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("retriever")
    docs = write_tiny_corpus(root / "corpus.jsonl")
    common = ["--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root / "idx"), "--max-length", "64"]
    for factory in ("Flat", "HNSW16", "IVF4,Flat"):
        dense = ["--retriever-name", "minilm", "--retriever-model", minilm_path(), "--faiss-type", factory]
        assert build_index.main([*common, *dense]) == 0
    assert build_index.main([*common, "--retriever-name", "minilm", "--retriever-model", minilm_path(), "--fp16"]) == 0
    assert build_index.main([*common, "--retriever-name", "bm25"]) == 0
    return root, docs


@pytest.fixture(scope="module")
def dense_server(built):
    root, _ = built
    with ServerProcess(
        "--index-path",
        str(root / "idx" / "minilm_Flat.index"),
        "--corpus-path",
        str(root / "corpus.jsonl"),
        "--max-wait-ms",
        "20",
    ) as server:
        yield server


def retrieve(server, queries, topk=None, return_scores=False, **extra):
    body = {"queries": queries, "topk": topk, "return_scores": return_scores, **extra}
    return httpx.post(f"{server.url}/retrieve", json=body, timeout=60)


def exact_top(docs, queries, k):
    """Exact search in-process: the same encoder, brute-force cosine over all passages."""
    encoder = Encoder(EncoderConfig(minilm_path(), max_length=64))
    passages = encoder.encode([d["contents"] for d in docs], is_query=False)
    scores = encoder.encode(queries, is_query=True) @ passages.T
    return [[docs[i]["id"] for i in np.argsort(-row, kind="stable")[:k]] for row in scores]


@pytest.mark.parametrize("n_queries", [1, 2, 3, 7])
@pytest.mark.parametrize("return_scores", [False, True])
def test_search_r1_api_in_both_modes_for_any_query_count(built, dense_server, n_queries, return_scores):
    _, docs = built
    queries = [
        f"where does the {c} {a} live"
        for c, a in zip(["red", "blue", "green", "black"] * 2, ["otter", "lynx", "bison", "heron"] * 2, strict=True)
    ][:n_queries]
    response = retrieve(dense_server, queries, topk=3, return_scores=return_scores)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert len(result) == n_queries
    expected = exact_top(docs, queries, 3)
    for hits, want in zip(result, expected, strict=True):
        assert len(hits) == 3
        if return_scores:
            assert set(hits[0]) == {"document", "score"}
            assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
            hits = [h["document"] for h in hits]
        assert all(set(doc) == {"id", "contents"} for doc in hits)
        assert [doc["id"] for doc in hits] == want


def test_default_topk_and_health(dense_server):
    response = retrieve(dense_server, ["purple gecko"])
    assert len(response.json()["result"][0]) == 3  # server --topk default
    health = httpx.get(f"{dense_server.url}/health").json()
    assert health["ready"] and health["corpus_size"] == 64 and health["index_type"] == "Flat"
    assert health["encoder"].endswith("model") and "queue_depth" in health and "cache_hit_rate" in health
    assert health["encoder_runtime"] == "onnx"  # the default on CPU with the cpu extra installed
    assert health["encoder_threads"] == len(os.sched_getaffinity(0))  # one per core the server may use


def test_concurrent_single_query_requests_are_batched(built, dense_server):
    _, docs = built
    queries = [
        f"the {c} {a}"
        for c in ["orange", "silver", "yellow", "purple"]
        for a in ["falcon", "walrus", "badger", "gecko", "otter", "lynx"]
    ]
    before = httpx.get(f"{dense_server.url}/health").json()

    async def fire():
        async with aiohttp.ClientSession() as session:

            async def one(q):
                async with session.post(f"{dense_server.url}/retrieve", json={"queries": [q], "topk": 1}) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one(q) for q in queries))

    answers = asyncio.run(fire())
    expected = exact_top(docs, queries, 1)
    assert [a[0] for a in answers] == [200] * len(queries)
    assert [a[1]["result"][0][0]["id"] for a in answers] == [e[0] for e in expected]
    after = httpx.get(f"{dense_server.url}/health").json()
    batches = after["batches"] - before["batches"]
    searched = after["queries_searched"] - before["queries_searched"]
    assert searched == len(queries)
    assert batches < len(queries) / 2, f"{searched} queries took {batches} batches"


def test_repeated_queries_hit_the_cache(dense_server):
    query = ["which animal eats heron food in valley 7"]
    first = retrieve(dense_server, query, topk=2).json()
    before = httpx.get(f"{dense_server.url}/health").json()
    second = retrieve(dense_server, ["  which animal eats heron food   in valley 7 "], topk=2).json()
    after = httpx.get(f"{dense_server.url}/health").json()
    assert first == second
    assert after["queries_searched"] == before["queries_searched"]  # answered from the cache
    assert after["cache_hit_rate"] > before["cache_hit_rate"]


@pytest.mark.parametrize(
    "body,message",
    [
        ({"queries": []}, "non-empty list"),
        ({"queries": "red otter"}, "non-empty list"),
        ({"queries": ["ok", 5]}, "queries[1] is a int"),
        ({"queries": ["q"] * 16_385}, "too many queries"),
        ({"query": 5}, "non-empty list"),
        ({"queries": ["q"], "topk": 0}, "'topk' must be an integer"),
        ({"queries": ["q"], "topk": 101}, "'topk' must be an integer"),
        ({"queries": ["q"], "topk": "3"}, "'topk' must be an integer"),
        ({"queries": ["q"], "return_scores": "yes"}, "'return_scores' must be true or false"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_malformed_requests_get_400_with_a_message(dense_server, body, message):
    response = httpx.post(f"{dense_server.url}/retrieve", json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["detail"]


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[" * 100_000, b'{"queries": ["q"], "topk": 1' + b"0" * 5000 + b"}", b"\xff\xfe{}"],
    ids=["invalid", "nested-100k-deep", "5000-digit-integer", "not-utf8"],
)
def test_unparsable_bodies_get_400_and_the_connection_stays_usable(dense_server, raw):
    """Python's parser raises RecursionError for deep nesting and ValueError past 4,300 digits: both are the
    client's fault. A 500 would also close the keep-alive connection under every request queued on it."""
    with httpx.Client(base_url=dense_server.url, timeout=30) as client:
        response = client.post("/retrieve", content=raw)
        assert response.status_code == 400 and "not valid JSON" in response.json()["detail"]
        assert response.headers.get("connection") != "close"
        after = client.post("/retrieve", json={"queries": ["red otter"], "topk": 1})
        assert after.status_code == 200 and len(after.json()["result"]) == 1


def test_odd_queries_are_answered_without_failing_their_neighbours(dense_server):
    """Blank, over-long and lone-surrogate queries in one batch with a normal one: each gets its own answer."""
    normal = "which animal eats heron food in valley 7"
    alone = retrieve(dense_server, [normal], topk=2).json()["result"][0]
    before = httpx.get(f"{dense_server.url}/health").json()
    raw = json.dumps({"queries": ["", "   ", "x" * 5000, "red \ud800 otter", normal], "topk": 2}).encode()
    response = httpx.post(f"{dense_server.url}/retrieve", content=raw, timeout=60)
    assert response.status_code == 200
    blank, blank2, long, surrogate, answer = response.json()["result"]
    assert blank == [] and blank2 == [] and len(long) == 2 and len(surrogate) == 2 and answer == alone
    after = httpx.get(f"{dense_server.url}/health").json()
    assert after["queries_truncated"] - before["queries_truncated"] == 1
    assert after["queries_repaired"] - before["queries_repaired"] == 1


def test_skyrl_single_query_form_is_answered_like_a_one_query_batch(dense_server):
    single = httpx.post(
        f"{dense_server.url}/retrieve", json={"query": "red otter", "topk": 2, "return_scores": True}, timeout=60
    )
    batch = retrieve(dense_server, ["red otter"], topk=2, return_scores=True)
    assert single.status_code == 200 and single.json() == batch.json()
    assert single.json()["result"][0][0]["document"]["contents"]


def test_search_r1s_whole_grpo_batch_fits_one_request(dense_server):
    """Search-R1 sends every trajectory's query of a step at once: 512 prompts x 5 = 2,560."""
    queries = [f"which animal eats heron food in valley {i % 9}" for i in range(2560)]
    response = retrieve(dense_server, queries, topk=3, return_scores=True)
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2560 and all(len(hits) == 3 for hits in result)


def test_bm25_server_finds_exact_words(built):
    root, docs = built
    with ServerProcess(
        "--retriever-name",
        "bm25",
        "--index-path",
        str(root / "idx" / "bm25"),
        "--corpus-path",
        str(root / "corpus.jsonl"),
    ) as server:
        response = retrieve(server, ["silver walrus", "valley 42"], topk=2, return_scores=True)
        assert response.status_code == 200, response.text
        silver, valley = response.json()["result"]
        assert silver[0]["document"]["contents"].startswith('"Silver Walrus"')
        assert "valley number 42 " in valley[0]["document"]["contents"]
        assert silver[0]["score"] > silver[1]["score"] > 0
        assert httpx.get(f"{server.url}/health").json()["index_type"] == "bm25"


@pytest.mark.parametrize("filename", ["minilm_HNSW16.index", "minilm_IVF4_Flat.index", "minilm_SQfp16.index"])
def test_approximate_and_fp16_indexes_find_each_passage_itself(built, filename):
    root, docs = built
    path = root / "idx" / filename
    retriever = DenseRetriever(path, encoder_config_from_meta(read_meta(path)))
    # MiniLM has no query/passage prefixes, so a passage's own text is its nearest neighbour in any index.
    rows, scores = retriever.search([d["contents"] for d in docs], 1)
    assert rows[:, 0].tolist() == list(range(len(docs)))
    assert np.all(scores[:, 0] > 0.99)


def test_build_resumes_from_saved_embeddings(built):
    root, _ = built
    shard = next((root / "idx" / "embeddings" / "minilm").glob("shard_*.npy"))
    stamp = shard.stat().st_mtime_ns
    args = ["--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root / "idx"), "--max-length", "64"]
    assert build_index.main([*args, "--retriever-name", "minilm", "--retriever-model", minilm_path()]) == 0
    assert shard.stat().st_mtime_ns == stamp  # reused, not re-encoded


def test_server_refuses_mismatched_corpus(built, tmp_path):
    root, docs = built
    small = tmp_path / "small.jsonl"
    small.write_text("".join(f'{{"id": "{d["id"]}", "contents": "x"}}\n' for d in docs[:5]))
    with pytest.raises(RuntimeError, match="holds 64 vectors but the corpus has 5"):
        ServerProcess("--index-path", str(root / "idx" / "minilm_Flat.index"), "--corpus-path", str(small))


def test_the_query_encoder_uses_the_cores_unless_torch_is_asked_for_by_name():
    from local_dense_retriever.retrieval_server import encoder_threads

    assert encoder_threads(None, "auto", "onnx", 16) == (1, 16)  # ONNX Runtime: one per core
    assert encoder_threads(None, "auto", "torch", 16) == (16, 16)  # "auto" without ONNX Runtime installed
    assert encoder_threads(None, "torch", "torch", 16) == (1, 16)  # the setting measured on shared cores
    assert encoder_threads(3, "auto", "torch", 16) == (3, 3) and encoder_threads(0, "auto", "onnx", 16) == (0, 0)


def test_approximate_indexes_search_wide_unless_told_otherwise(built):
    """A new IVF or HNSW file keeps faiss's narrow defaults (nprobe 1, efSearch 16); the server searches wider by
    default, keeps a file's wider setting, and takes the user's parameters as given."""
    import faiss

    from local_dense_retriever.index import search_params_for

    root, _ = built

    def served(filename, params="auto"):
        path = root / "idx" / filename
        return DenseRetriever(path, encoder_config_from_meta(read_meta(path)), search_params=params)

    ivf = served("minilm_IVF4_Flat.index")
    assert ivf.search_params == "nprobe=64" and faiss.extract_index_ivf(ivf.index).nprobe == 64
    hnsw = served("minilm_HNSW16.index")
    assert hnsw.search_params == "efSearch=128" and faiss.downcast_index(hnsw.index).hnsw.efSearch == 128
    assert served("minilm_Flat.index").search_params == ""  # exact: nothing to widen
    assert faiss.extract_index_ivf(served("minilm_IVF4_Flat.index", "nprobe=2").index).nprobe == 2
    assert faiss.extract_index_ivf(served("minilm_IVF4_Flat.index", "").index).nprobe == 1  # the file's own
    wide = faiss.read_index(str(root / "idx" / "minilm_IVF4_Flat.index"))
    faiss.extract_index_ivf(wide).nprobe = 256
    assert search_params_for(wide) == ""  # wider than the default already
    with pytest.raises(RuntimeError, match="nprob"):
        served("minilm_IVF4_Flat.index", "nprob=3")  # a misspelt name is refused, not ignored
