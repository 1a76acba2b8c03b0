"""The persistent Serper cache against the Serper stand-in on 127.0.0.1: billed calls happen once per query and
settings, later runs and other processes read the answers, replay-only never calls the API, and failures are never
cached."""

import asyncio
import multiprocessing

import httpx
import pytest

from slime_search.rollout.eval_metrics import evaluate_samples
from slime_search.rollout.sample_metrics import rollout_metrics
from slime_search.search_r1.search_clients import SearchError, SerperClient, SerperConfig
from slime_search.search_r1.serper_cache import CacheSettings, SerperCache, normalise_query
from slime_search.types import Sample
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)
KEY = "cache-test-key"


@pytest.fixture(scope="module")
def serper():
    argv = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", KEY]
    with ServerProcess(argv) as process:
        yield process


def api_calls(serper, query: str) -> int:
    return httpx.get(f"{serper.url}/health").json()["calls"].get(query, 0)


def search(serper, queries, **config):
    """Each query through a new client (a new run): documents and origins."""

    async def run():
        client = SerperClient(SerperConfig(endpoint=f"{serper.url}/search", backoff_base_s=0.01, **config))
        try:
            return [await client.search_with_origin(q) for q in queries]
        finally:
            await client.close()

    return asyncio.run(run())


def test_a_second_run_reads_the_answer_and_calls_the_api_no_more(serper, tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    cache = str(tmp_path / "serper.sqlite")
    [(first, origin)] = search(serper, ["who built the eiffel tower"], cache_path=cache)
    assert origin == "api" and api_calls(serper, "who built the eiffel tower") == 1
    [(again, origin)] = search(serper, ["who built the eiffel tower"], cache_path=cache)
    assert origin == "cache" and again == first and api_calls(serper, "who built the eiffel tower") == 1
    assert len(SerperCache(cache)) == 1


def test_query_variants_share_an_entry_but_settings_do_not(serper, tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    cache = str(tmp_path / "serper.sqlite")
    search(serper, ["Cafe  de Flore "], cache_path=cache, topk=2)
    [(_, origin)] = search(serper, ["cafe de flore"], cache_path=cache, topk=2)
    assert origin == "cache" and api_calls(serper, "Cafe de Flore") == 1
    [(docs, origin)] = search(serper, ["cafe de flore"], cache_path=cache, topk=3)
    assert origin == "api" and len(docs) == 3
    [(_, origin)] = search(serper, ["cafe de flore"], cache_path=cache, topk=2, snippet_only=False)
    assert origin == "api"
    assert normalise_query(" Caf\u0065\u0301  X ") == normalise_query("caf\u00e9 x")


def test_replay_only_needs_no_key_and_never_calls_the_api(serper, tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    cache = str(tmp_path / "serper.sqlite")
    [(recorded, _)] = search(serper, ["tallest tower in paris"], cache_path=cache)
    monkeypatch.delenv("SERPER_API_KEY")
    [(replayed, origin)] = search(serper, ["tallest tower in paris"], cache_path=cache, replay_only=True)
    assert replayed == recorded and origin == "cache"
    with pytest.raises(SearchError, match="replay-only"):
        search(serper, ["a question never asked"], cache_path=cache, replay_only=True)
    assert api_calls(serper, "a question never asked") == 0
    with pytest.raises(ValueError, match="--serper-cache"):
        SerperConfig(replay_only=True)


def test_failed_answers_are_not_cached(serper, tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    cache = str(tmp_path / "serper.sqlite")
    with pytest.raises(SearchError):
        search(serper, ["garbled"], cache_path=cache, retries=0)
    assert len(SerperCache(cache)) == 0


def write_entries(path: str, worker: int, count: int) -> None:
    cache = SerperCache(path)
    settings = CacheSettings("http://x/search", 3, True)
    for i in range(count):
        cache.put(f"worker {worker} query {i}", settings, [{"contents": f"{worker}-{i}"}])


def test_processes_writing_one_cache_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    SerperCache(path)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=write_entries, args=(path, w, 150)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    cache = SerperCache(path)
    assert len(cache) == 600
    assert cache.get("worker 3 query 149", CacheSettings("http://x/search", 3, True)) == [{"contents": "3-149"}]


def test_billed_calls_and_cache_hits_reach_the_step_and_eval_metrics():
    samples = [
        Sample(metrics={"searches": 2, "search_billed": 2, "search_cache_hits": 0, "search_latency_s": 0.1}),
        Sample(metrics={"searches": 3, "search_billed": 1, "search_cache_hits": 2, "search_latency_s": 0.1}),
        Sample(metrics={"searches": 0}),
    ]
    metrics = rollout_metrics(samples)
    assert metrics["rollout/search_billed_calls"] == 3 and metrics["rollout/search_cache_hits"] == 2
    assert metrics["rollout/search_cache_hit_rate"] == pytest.approx(0.4)
    assert "rollout/search_billed_calls" not in rollout_metrics(
        [Sample(metrics={"searches": 1, "search_latency_s": 0.1})]
    )
    for s in samples:
        s.reward = {"score": 0.0}
    assert evaluate_samples(samples)["eval/search_cache_hits"] == 2
