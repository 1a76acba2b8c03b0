"""The Search-R1 plugin's preflight: the retriever answers one query (a real one on 127.0.0.1), or Serper has its key
or its replay cache, before anything starts."""

import socket
import time

import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import preflight
from slime_search.utils.net import free_port
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(300)


def task_args(**values):
    return search_r1_args(hf_checkpoint="ckpt", **values)


@pytest.fixture(scope="module")
def bm25_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bm25")
    write_tiny_corpus(root / "corpus.jsonl")
    index_args = ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main(index_args) == 0
    with RetrievalServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl")
    ) as server:
        yield server


def test_a_retriever_that_is_down_is_named_at_once():
    url = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot reach the retriever at " + url) as refused:
        preflight(task_args(search_url=url))
    assert time.monotonic() - started < 5  # connection refused is immediate, well under the 10 s timeout
    assert "retrieval_server.py" in str(refused.value)  # how to start one
    preflight(task_args(search_url=url, search_preflight_timeout=0.0))  # 0: no probe


def test_a_running_retriever_passes_and_a_wrong_path_does_not(bm25_server):
    preflight(task_args(search_url=f"{bm25_server.url}/retrieve"))
    with pytest.raises(RuntimeError, match="answered HTTP 404"):
        preflight(task_args(search_url=f"{bm25_server.url}/search"))


def test_a_retriever_that_does_not_answer_fails_at_the_preflight_timeout():
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/retrieve"
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"the retriever at {url} did not answer one query within 0.5 s"):
            preflight(task_args(search_url=url, search_preflight_timeout=0.5))
    assert time.monotonic() - started < 5


def test_serper_needs_its_key_or_its_replay_cache_and_is_never_called(monkeypatch, tmp_path):
    never = f"http://127.0.0.1:{free_port()}/search"  # a call would fail: the preflight makes none
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="SERPER_API_KEY"):
        preflight(task_args(search_backend="serper", serper_url=never))
    monkeypatch.setenv("SERPER_API_KEY", "key")
    preflight(task_args(search_backend="serper", serper_url=never))
    monkeypatch.delenv("SERPER_API_KEY")
    cache = tmp_path / "serper.sqlite"
    replay = {"search_backend": "serper", "serper_replay_only": True, "serper_cache": str(cache)}
    with pytest.raises(RuntimeError, match="is not a file"):
        preflight(task_args(**replay))
    cache.write_bytes(b"")
    preflight(task_args(**replay))


def test_the_eval_cli_checks_flags_and_the_retriever_before_starting_anything(tiny_checkpoint, tmp_path, capsys):
    from slime_search.eval import main

    url = f"http://127.0.0.1:{free_port()}/retrieve"
    common = ["--hf-checkpoint", str(tiny_checkpoint), "--eval-prompt-data", "nq", str(tmp_path / "absent.parquet")]
    with pytest.raises(SystemExit) as exited:
        main([*common, "--search-url", url, "--output", str(tmp_path / "out" / "eval.json")])
    assert f"preflight failed: cannot reach the retriever at {url}" in str(exited.value.code)
    assert not (tmp_path / "out").exists()  # nothing was started or written
    with pytest.raises(SystemExit) as exited:
        main([*common, "--max-turns", "0", "--no-final-turn"])
    assert exited.value.code == 2 and "--max-turns 0 with --no-final-turn" in capsys.readouterr().err
