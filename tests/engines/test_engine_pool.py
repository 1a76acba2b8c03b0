"""Generation over several engines: a trajectory keeps its engine, new trajectories go to the least busy one, a fault
moves the request to another live engine at once, and an engine killed in the middle of a rollout costs no trajectory;
the dead engine is found, started again on its address, and serves the weights pushed next."""

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from slime_search.engines.client import EngineError
from slime_search.engines.pool import EnginePool, PoolConfig
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


@pytest.fixture(scope="module")
def flaky():
    argv = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    with ServerProcess(argv) as process:
        yield process


def calls(flaky, input_ids: list[int]) -> int:
    return httpx.get(f"{flaky.url}/generate_calls").json().get(",".join(map(str, input_ids)), 0)


def run_pool(urls: list[str], body, **config):
    """`body(pool)` inside an event loop with a pool over `urls`; the pool is closed after."""

    async def go():
        pool = EnginePool(urls, PoolConfig(backoff_s=0.01, **config))
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(go())


def test_a_dead_engine_costs_one_attempt_then_the_trajectory_moves_and_stays(flaky):
    async def body(pool):
        route = pool.route()
        first = await route.generate({"max_new_tokens": 1}, [0, 0, 11])
        second = await route.generate({"max_new_tokens": 1}, [0, 0, 12])
        return pool, route, first, second

    pool, route, first, second = run_pool([DEAD, flaky.url], body, retries=1)
    assert first["output_ids"] == [7] and second["output_ids"] == [7]
    assert route.url == flaky.url and route.failovers == 1 and pool.failovers == 1
    assert list(pool.down) == [DEAD] and pool.live() == [flaky.url]


def test_an_engine_marked_down_is_tried_again_after_a_while(flaky):
    async def body(pool):
        await pool.route().generate({}, [0, 0, 13])
        assert pool.live() == [flaky.url]  # within the window, even on a busy machine
        await asyncio.sleep(2.1)
        return pool.live()

    assert run_pool([DEAD, flaky.url], body, retry_down_after_s=2.0) == [DEAD, flaky.url]


def test_new_trajectories_spread_over_engines_and_keep_theirs(flaky):
    # one server under two addresses: two engines as far as the pool can tell
    other = flaky.url.replace("127.0.0.1", "localhost")

    async def body(pool):
        routes = [pool.route() for _ in range(4)]
        await asyncio.gather(*(r.generate({}, [0, 0, 20 + i]) for i, r in enumerate(routes)))
        chosen = [r.url for r in routes]
        await asyncio.gather(*(r.generate({}, [0, 0, 30 + i]) for i, r in enumerate(routes)))
        return chosen, [r.url for r in routes]

    chosen, after = run_pool([flaky.url, other], body)
    assert sorted(chosen) == sorted([flaky.url, other] * 2)  # the least busy engine takes each new trajectory
    assert after == chosen  # and every trajectory stays where it started


def test_a_transient_fault_of_the_only_engine_is_re_sent_after_a_backoff(flaky):
    async def body(pool):
        return await pool.route().generate({}, [503, 2, 40])

    assert run_pool([flaky.url], body, retries=2)["output_ids"] == [7]
    assert calls(flaky, [503, 2, 40]) == 3


def test_a_refused_request_is_neither_re_sent_nor_moved(flaky):
    other = flaky.url.replace("127.0.0.1", "localhost")

    async def body(pool):
        return await pool.route().generate({}, [400, 0, 41])

    with pytest.raises(EngineError, match="attempt 1") as failed:
        run_pool([flaky.url, other], body, retries=3)
    assert failed.value.status == 400 and calls(flaky, [400, 0, 41]) == 1


def test_no_engine_left_fails_within_the_bound_and_mark_up_brings_one_back(flaky):
    async def body(pool):
        with pytest.raises(EngineError, match="attempt 3"):
            await pool.route().generate({}, [0, 0, 42])
        assert pool.live() == []
        pool.mark_up(DEAD)
        return pool.live()

    start = time.perf_counter()
    assert run_pool([DEAD, "http://127.0.0.1:7"], body, retries=2) == [DEAD]
    assert time.perf_counter() - start < 5


@pytest.mark.slow
def test_an_engine_killed_mid_rollout_costs_no_trajectory_and_comes_back_with_the_pushed_weights(
    tiny_checkpoint, tmp_path
):
    """Two CPU engines; one is SIGKILLed while the trajectories are being generated. Every trajectory still completes
    (its turns move to the live engine), the dead engine is found, started on its own address, and then serves the
    weight version pushed to all engines."""
    from slime_search.engines.deployment import EngineConfig, start_engines
    from slime_search.rollout.sample_metrics import rollout_metrics
    from slime_search.search_r1.config import search_r1_args
    from slime_search.search_r1.generate import close_resources, generate, session_for
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.types import Sample
    from slime_search.weight_sync.disk import update_engines_from_disk

    engines = start_engines(EngineConfig(str(tiny_checkpoint), cpu_engines=2, health_timeout_s=10), tmp_path)
    try:
        victim = engines.worker_urls[1]
        args = search_r1_args(
            engine_url=engines.url,
            engine_urls=engines.worker_urls,
            hf_checkpoint=str(tiny_checkpoint),
            search_url="http://127.0.0.1:9/retrieve",  # never reached: the random policy does not search in 48 tokens
            max_turns=0,  # the answer-only turn alone: one engine request per trajectory
            apply_chat_template=True,
        )

        async def rollout():
            samples = [Sample(prompt=make_prompt(f"who is the red otter {i}")) for i in range(16)]
            # about 2 s of decoding per engine (8 rows x 400 tokens at ~5 ms a step)
            params = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
            tasks = [asyncio.ensure_future(generate(args, s, params)) for s in samples]
            while not session_for(args).resources.engines.in_flight[victim]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the victim's batch is decoding
            assert not any(t.done() for t in tasks)
            os.kill(engines.slots[victim].process.proc.pid, signal.SIGKILL)
            try:
                return await asyncio.gather(*tasks)
            finally:
                await close_resources()

        samples = asyncio.run(rollout())
        metrics = rollout_metrics(samples)
        assert all(s.trainable for s in samples) and metrics["rollout/engine_errors"] == 0
        assert metrics["rollout/engine_failovers"] >= 1
        assert {v for s in samples for v in s.weight_versions} == {"0"}

        assert engines.find_down() == [victim]
        engines.restart([victim])
        assert engines.wait_restarted() == [victim] and engines.find_down() == []
        assert Path(tmp_path / "engine-1.restart1.log").is_file()
        served = asyncio.run(update_engines_from_disk(engines.worker_urls, str(tiny_checkpoint), "1"))
        assert served == ["1", "1"]
    finally:
        engines.stop()
