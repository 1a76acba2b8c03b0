"""Search faults and web-search cost: a retriever restart ridden out, searches that find nothing marked, and a
Serper budget counted over the run (real BM25 server and the Serper stand-in on 127.0.0.1)."""

import asyncio
import random
import socket
import threading
import time

import httpx
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.generate import observation_ids, observation_text
from slime_search.search_r1.search_clients import (
    LocalSearchClient,
    LocalSearchConfig,
    SearchError,
    SerperClient,
    SerperConfig,
    retry_pause,
)
from slime_search.search_r1.serper_budget import BudgetSpent, SerperBudget, SpendLedger
from slime_search.utils.server_process import ServerProcess
from tests.retriever_helpers import write_tiny_corpus
from tests.search_r1.conftest import SERPER_KEY

pytestmark = pytest.mark.timeout(300)
KEY = SERPER_KEY  # the key the shared stand-in accepts (conftest.py)


def test_retries_wait_at_least_the_servers_retry_after_and_stop_at_the_window():
    config = LocalSearchConfig("http://x/retrieve", retry_window_s=10.0, backoff_base_s=0.25, backoff_cap_s=4.0)
    rng = random.Random(0)
    pauses = [retry_pause(a, 0.0, 0.0, config, rng) for a in range(8)]
    assert all(0 <= p <= min(4.0, 0.25 * 2**a) for a, p in enumerate(pauses))  # full jitter under the cap
    assert retry_pause(0, 3.0, 0.0, config, rng) >= 3.0  # a 503/429's Retry-After is honoured
    assert retry_pause(0, 3.0, 8.0, config, rng) is None  # would start after the window: give up
    counted = LocalSearchConfig("http://x/retrieve", retries=2)
    assert retry_pause(1, 0.0, 0.0, counted, rng) is not None and retry_pause(2, 0.0, 0.0, counted, rng) is None
    assert LocalSearchConfig("http://x/retrieve", retry_window_s=30, timeout_s=60).deadline_s == 2 * 90 + 1


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    write_tiny_corpus(root / "corpus.jsonl")
    args = ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main(args) == 0
    return root


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def search_during_restart(root, down_s: float, **config) -> tuple[object, float]:
    """One search sent while the retriever is down; the retriever comes up on its port `down_s` later. (The search
    runs on a thread of its own: the server is started from this one, as its child dies with the thread that
    started it.)"""
    port = free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    outcome = {}

    async def search():
        client = LocalSearchClient(LocalSearchConfig(url, topk=1, timeout_s=5, **config))
        try:
            return await client.search("red walrus")
        except SearchError as err:
            return err
        finally:
            await client.close()

    def run():
        began = time.monotonic()
        outcome["result"] = asyncio.run(search())
        outcome["seconds"] = time.monotonic() - began

    searcher = threading.Thread(target=run)
    searcher.start()
    time.sleep(down_s)
    with RetrievalServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl"),
        "--port", str(port),
    ):  # fmt: skip
        searcher.join(timeout=120)
    return outcome["result"], outcome["seconds"]


def test_a_search_rides_out_a_retriever_restart_within_its_retry_window(bm25_index):
    outcome, seconds = search_during_restart(bm25_index, 3.5)  # the default window: 30 s
    assert isinstance(outcome, list), outcome
    assert outcome[0]["document"]["contents"].startswith('"Red Walrus"') and seconds >= 3.5
    short, seconds = search_during_restart(bm25_index, 3.5, retry_window_s=1.0)  # a window shorter than the restart
    assert isinstance(short, SearchError) and "attempts over" in str(short) and seconds < 3.5


def calls_of(server, query: str) -> int:
    return httpx.get(f"{server.url}/health").json()["calls"].get(query, 0)


def run_searches(server, queries, budget=None, **config):
    """Each query in turn through one client: its documents or its exception."""

    async def run():
        settings = SerperConfig(endpoint=f"{server.url}/search", backoff_base_s=0.01, **config)
        client = SerperClient(settings, budget=budget)
        outcomes = []
        try:
            for query in queries:
                try:
                    outcomes.append(await client.search(query))
                except SearchError as err:
                    outcomes.append(err)
        finally:
            await client.close()
        return outcomes

    return asyncio.run(run())


def test_a_search_that_finds_nothing_reads_as_no_results_not_an_empty_block(monkeypatch, serper, tiny_checkpoint):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SERPER_API_KEY", KEY)
    [docs] = run_searches(serper, ["nothing"])
    assert docs == []
    assert observation_text(docs) == "\n\n<information></information>\n\n"  # Search-R1's own (verified in its code)
    text = "No search results are found."
    assert observation_text(docs, text) == f"\n\n<information>{text}</information>\n\n"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    ids, truncated = observation_ids(tokenizer, docs, 500, text)
    assert tokenizer.decode(ids) == observation_text(docs, text) and not truncated


def test_the_budget_caps_billed_calls_over_the_run_and_cached_answers_stay_free(monkeypatch, serper, tmp_path):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    ledger = tmp_path / "run" / "serper_spend.sqlite"
    budget = SerperBudget(max_calls=3, ledger_path=str(ledger))
    cache = str(tmp_path / "serper.sqlite")
    first = run_searches(
        serper, ["budget one", "down", "budget two", "budget one"], budget, cache_path=cache, retries=0
    )
    assert isinstance(first[0], list) and isinstance(first[2], list) and first[3] == first[0]  # the last: cached
    assert isinstance(first[1], SearchError) and not isinstance(first[1], BudgetSpent)  # failed, yet maybe billed
    assert SpendLedger(ledger).spent() == 3
    # a later rollout (a new client, as each rollout builds its own) draws on the same run budget
    before = calls_of(serper, "budget three")
    [spent, cached] = run_searches(serper, ["budget three", "budget two"], budget, cache_path=cache)
    assert isinstance(spent, BudgetSpent) and "--serper-budget-calls 3" in str(spent) and "stops" in str(spent)
    assert calls_of(serper, "budget three") == before  # never sent
    assert isinstance(cached, list)  # from the cache: free, so still answered
    replay = SerperBudget(max_calls=3, at_budget="replay", ledger_path=str(ledger))
    [missing, hit] = run_searches(serper, ["budget four", "budget one"], replay, cache_path=cache)
    assert type(missing) is SearchError and "budget is spent" in str(missing) and isinstance(hit, list)
    assert SpendLedger(ledger).spent() == 3


def test_the_ledger_never_lets_two_processes_take_the_last_call(tmp_path):
    path = tmp_path / "spend.sqlite"
    granted = []

    def take(n):
        ledger = SpendLedger(path)  # a connection of its own, as another process would have
        granted.append(sum(ledger.reserve(25) for _ in range(n)))

    threads = [threading.Thread(target=take, args=(20,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == 25 and SpendLedger(path).spent() == 25


def test_budget_flags_in_calls_or_dollars_and_their_errors():
    assert SerperBudget(max_usd=2.5, usd_per_call=0.001, ledger_path="x").call_cap == 2500
    assert SerperBudget(max_calls=100, max_usd=0.05, usd_per_call=0.001, ledger_path="x").call_cap == 50
    assert SerperBudget().call_cap is None and not SerperBudget().limited
    with pytest.raises(ValueError, match="--save"):
        SerperBudget(max_calls=10)
    with pytest.raises(ValueError, match="--serper-at-budget"):
        SerperBudget(at_budget="ignore")


def test_at_the_budget_a_trajectory_asks_the_run_to_stop_and_the_guard_stops_it(
    monkeypatch, serper, tiny_checkpoint, tmp_path
):
    import json

    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard
    from slime_search.rollout.rollout import first_errors
    from slime_search.search_r1.config import search_r1_args
    from slime_search.search_r1.generate import close_resources, generate
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.types import Sample, Status

    monkeypatch.setenv("SERPER_API_KEY", KEY)
    script = {"zebra": ["<search> spend a </search>", "<answer> a </answer>"], "yak": ["<search> spend b </search>"]}
    (tmp_path / "script.json").write_text(json.dumps(script))
    engine = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_checkpoint), "--script",
              str(tmp_path / "script.json"), "--port", "0"]  # fmt: skip
    with ServerProcess(engine) as engine_server:
        args = search_r1_args(
            engine_url=engine_server.url, hf_checkpoint=str(tiny_checkpoint), search_backend="serper",
            serper_url=f"{serper.url}/search", serper_budget_calls=1, save=str(tmp_path / "run"), apply_chat_template=True,
        )  # fmt: skip

        async def both():
            try:
                out = []
                for question in ("zebra", "yak"):
                    sample = Sample(prompt=make_prompt(f"the {question} question"), label={"target": ["a"]})
                    out.append(await generate(args, sample, {"temperature": 1.0, "max_new_tokens": 50}))
                return out
            finally:
                await close_resources()

        done, stopped = asyncio.run(both())
    assert done.status is Status.COMPLETED and done.metrics["search_billed"] == 1
    assert done.metrics["search_cost_usd"] == pytest.approx(0.001)
    assert stopped.status is Status.FAILED and stopped.metadata["finish_reason"] == "stop_run"
    assert SpendLedger(tmp_path / "run" / "serper_spend.sqlite").spent() == 1  # the ledger of the run folder
    [event] = HealthGuard(HealthConfig()).check_rollout(3, {"rollout/samples": 2.0}, first_errors([done, stopped]))
    assert event.action == "stop" and "--serper-budget-calls 1" in event.message


def test_the_reports_web_search_cost_is_the_ledgers_after_a_retried_search_and_a_rollback(
    monkeypatch, serper, tiny_checkpoint, tmp_path
):
    """Step 0's search is answered at its second attempt (Serper rate-limited the first: both may have been billed);
    step 1 is undone by a rollback (its record dropped) and redone with another search. Serper may have billed 4
    calls; the step records kept name 2 (the first requester of each answered search, in the steps kept). The report
    names the ledger's figure, read from the steps' records (rollout/search_ledger_calls), and says which is which."""
    import json

    from slime_search.metrics import MetricsSink
    from slime_search.report import search_cost_section
    from slime_search.rollout.sample_metrics import rollout_metrics
    from slime_search.search_r1.config import search_r1_args
    from slime_search.search_r1.generate import close_resources, generate
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.types import Sample

    monkeypatch.setenv("SERPER_API_KEY", KEY)
    script = {
        "zebra": ["<search> busy </search>", "<answer> a </answer>"],  # a 429 with Retry-After 1 s, then answered
        "yak": ["<search> ledger undone </search>", "<answer> a </answer>"],
        "ibex": ["<search> ledger redone </search>", "<answer> a </answer>"],
    }
    (tmp_path / "script.json").write_text(json.dumps(script))
    engine = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_checkpoint), "--script",
              str(tmp_path / "script.json"), "--port", "0"]  # fmt: skip
    run = tmp_path / "run"
    sink = MetricsSink(run)
    with ServerProcess(engine) as engine_server:
        args = search_r1_args(
            engine_url=engine_server.url, hf_checkpoint=str(tiny_checkpoint), search_backend="serper",
            serper_url=f"{serper.url}/search", serper_budget_calls=100, save=str(run), apply_chat_template=True,
        )  # fmt: skip

        def step(number: int, question: str) -> None:
            async def rollout():
                try:
                    sample = Sample(prompt=make_prompt(f"the {question} question"), label={"target": ["a"]})
                    return await generate(args, sample, {"temperature": 1.0, "max_new_tokens": 50})
                finally:
                    await close_resources()

            sink.log(number, rollout_metrics([asyncio.run(rollout())]))

        step(0, "zebra")
        step(1, "yak")
        sink.drop_from(1)  # a rollback to the checkpoint of step 1: its record goes, its calls were billed
        step(1, "ibex")
    spent = SpendLedger(run / "serper_spend.sqlite").spent()
    records = sink.read()
    assert spent == 4 and sum(r["rollout/search_billed_calls"] for r in records) == 2
    assert [r["rollout/search_ledger_calls"] for r in records] == [2.0, 4.0]  # the run's count at each step
    section = search_cost_section(records)
    assert f"Web search over the run: {spent} billed calls, $0.004, as the Serper budget ledger counts them" in section
    assert "The step records kept sum to 2 billed calls, $0.002" in section
