"""Corpus store, encoder conventions, micro-batching and cache, without a server."""

import asyncio

import numpy as np
import pytest

from local_dense_retriever.batching import LRUCache, MicroBatcher, normalize_query, run_search
from local_dense_retriever.corpus import Corpus
from local_dense_retriever.encoder import BGE_QUERY_INSTRUCTION, EncoderConfig, add_prefix, length_batches
from local_dense_retriever.index import apply_fp16, index_filename
from tests.retriever_helpers import write_tiny_corpus


def test_corpus_lookup_by_row_skips_blank_lines(tmp_path):
    docs = write_tiny_corpus(tmp_path / "c.jsonl")
    corpus = Corpus(tmp_path / "c.jsonl")
    assert len(corpus) == len(docs) == 64
    assert corpus[0] == docs[0] and corpus[11] == docs[11] and corpus[63] == docs[63]
    assert (tmp_path / "c.jsonl.offsets.npy").is_file()
    assert Corpus(tmp_path / "c.jsonl")[40] == docs[40]  # reopened from the saved offsets
    with pytest.raises(IndexError, match="row 64 out of range"):
        corpus[64]
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        Corpus(tmp_path / "missing.jsonl")


def test_encoder_conventions():
    assert add_prefix(["q"], "e5", is_query=True) == ["query: q"]
    assert add_prefix(["p"], "e5", is_query=False) == ["passage: p"]
    assert add_prefix(["q"], "bge", is_query=True) == [BGE_QUERY_INSTRUCTION + "q"]
    assert add_prefix(["p"], "bge", is_query=False) == ["p"]
    assert EncoderConfig("intfloat/e5-base-v2").resolved_family() == "e5"
    assert EncoderConfig("BAAI/bge-base-en-v1.5").resolved_pooling() == "cls"
    assert EncoderConfig("all-MiniLM-L6-v2").resolved_pooling() == "mean"
    with pytest.raises(ValueError, match="valid: mean, cls"):
        EncoderConfig("x", pooling="max").resolved_pooling()


def test_fp16_factories_and_file_names():
    assert apply_fp16("Flat") == "SQfp16"
    assert apply_fp16("IVF1024,Flat") == "IVF1024,SQfp16"
    with pytest.raises(ValueError, match="not 'HNSW64'"):
        apply_fp16("HNSW64")
    assert index_filename("e5", "IVF16,PQ8") == "e5_IVF16_PQ8.index"


def test_lru_cache_evicts_least_recent():
    cache = LRUCache(2)
    cache.put(("a", 3), [(1, 0.5)])
    cache.put(("b", 3), [(2, 0.5)])
    assert cache.get(("a", 3)) == [(1, 0.5)]
    cache.put(("c", 3), [(3, 0.5)])  # evicts b, the least recently used
    assert cache.get(("b", 3)) is None and cache.get(("c", 3)) == [(3, 0.5)]
    assert cache.hit_rate == pytest.approx(2 / 3)
    assert normalize_query("  who  is\tX ") == "who is X"


def fake_search(calls):
    """Row = length of the query; raises on the query 'poison'."""

    def search(queries, topk):
        calls.append(list(queries))
        if "poison" in queries:
            raise RuntimeError("index exploded")
        rows = np.array([[len(q) + j for j in range(topk)] for q in queries], dtype=np.int64)
        rows[:, -1] = -1  # faiss pads missing results with -1
        return rows, np.ones(rows.shape, dtype=np.float32)

    return search


def test_texts_are_encoded_in_batches_of_nearly_one_length():
    lengths = [5, 9, 3, 10, 30, 9, 4, 9, 9, 9, 48, 52, 60]
    batches = [b.tolist() for b in length_batches(lengths, 3)]
    assert sorted(row for b in batches for row in b) == list(range(len(lengths)))  # every text once
    # shortest first; a batch ends when full or when a text is more than max(1, shortest // 8) tokens longer
    assert batches == [[2, 6], [0], [1, 5, 7], [8, 9, 3], [4], [10, 11], [12]]
    assert length_batches([], 64) == []


def test_a_lone_request_is_searched_without_waiting_for_company():
    """The wait for company applies once requests come together; a lone one is searched at once. A batcher told to
    wait 60 s would not answer within the 20 s bound otherwise."""

    async def scenario():
        calls = []
        batcher = MicroBatcher(fake_search(calls), max_batch_size=64, max_wait_s=60.0)
        batcher.start()
        first = await asyncio.wait_for(batcher.submit(["a"], 2), 20)
        second = await asyncio.wait_for(batcher.submit(["bb"], 2), 20)
        together = await asyncio.wait_for(asyncio.gather(batcher.submit(["c"], 2), batcher.submit(["dd"], 2)), 20)
        await batcher.stop()
        return calls, first, second, together

    calls, first, second, together = asyncio.run(scenario())
    assert calls == [["a"], ["bb"], ["c", "dd"]] and first == [[(1, 1.0)]] and second == [[(2, 1.0)]]
    assert together == [[[(1, 1.0)]], [[(2, 1.0)]]]


def test_run_search_deduplicates_and_drops_padding():
    calls = []
    hits = run_search(fake_search(calls), ["aa", "b", "aa"], 3)
    assert calls == [["aa", "b"]]
    assert hits == [[(2, 1.0), (3, 1.0)], [(1, 1.0), (2, 1.0)], [(2, 1.0), (3, 1.0)]]


def test_micro_batcher_batches_concurrent_requests_and_isolates_failures():
    async def scenario():
        calls = []
        batcher = MicroBatcher(fake_search(calls), max_batch_size=64, max_wait_s=0.05)
        batcher.start()
        queries = [f"q{'x' * i}" for i in range(20)]
        results = await asyncio.gather(
            *(batcher.submit([q], 2) for q in queries), batcher.submit(["poison"], 2), return_exceptions=True
        )
        await batcher.stop()
        return calls, queries, results

    calls, queries, results = asyncio.run(scenario())
    # All 21 requests arrived within the wait window: one combined call, then one call per request to isolate
    # the failure.
    assert len(calls[0]) == 21
    assert len(calls) == 1 + 21
    for query, result in zip(queries, results[:-1], strict=True):
        assert result == [[(len(query), 1.0)]]
    assert isinstance(results[-1], RuntimeError)


def test_listen_socket_gives_connections_tcp_nodelay():
    # Without TCP_NODELAY on accepted connections, each keep-alive response stalls ~40 ms on a delayed ACK.
    import socket

    from slime_search.utils.net import listen_socket

    async def accepted_nodelay():
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


@pytest.mark.gpu
def test_faiss_index_shards_over_gpus():
    faiss = pytest.importorskip("faiss")
    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        pytest.skip("needs faiss with CUDA GPUs (faiss-gpu); this machine has none")
    from local_dense_retriever.index import to_all_gpus

    vectors = np.random.default_rng(0).standard_normal((1000, 32)).astype(np.float32)
    cpu = faiss.IndexFlatIP(32)
    cpu.add(vectors)
    gpu = to_all_gpus(cpu, fp16=True)
    _, rows = gpu.search(vectors[:10], 1)
    assert rows[:, 0].tolist() == list(range(10))
