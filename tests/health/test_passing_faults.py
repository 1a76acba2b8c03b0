"""Faults that pass, told from faults that come back: the guard pauses on a step whose searches failed, or whose reward
service failed for a passing reason, with a growing wait, and stops past --health-max-outage-hours; a reward plugin's
bug stops at once. What counts as passing is read off real exceptions of real HTTP clients against real servers on
127.0.0.1 (down, overloaded, too slow), and off the errors a full disk raises."""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
from argparse import Namespace
from pathlib import Path

import aiohttp
import httpx
import pytest

from slime_search.health.config import HealthConfig
from slime_search.health.events import OUTAGE
from slime_search.health.guard import HealthGuard
from slime_search.health.rules.inputs import RETRY_IN, backoff_s
from slime_search.utils.faults import disk_full_error, is_transient
from slime_search.utils.net import free_port
from slime_search.utils.server_process import ServerProcess
from tests.health.test_guard import rollout

pytestmark = pytest.mark.timeout(120)
SERVICE = Path(__file__).parent / "reward_service.py"
SEARCH_ERROR = {"search_error": "http://127.0.0.1:9/retrieve: search failed after 1 attempts: ClientConnectorError"}
FAILING = rollout(trainable=0, search_calls=16, search_failures=16)


def test_the_wait_starts_at_15_s_and_doubles_to_5_minutes():
    assert [backoff_s(retry) for retry in range(8)] == [15, 30, 60, 120, 240, 300, 300, 300]


def test_a_retriever_outage_pauses_with_growing_waits_and_stops_past_its_limit():
    guard = HealthGuard(HealthConfig(max_outage_hours=1))
    now, waits = 0.0, []
    while True:
        [event] = guard.check_rollout(7, FAILING, SEARCH_ERROR, now)
        if event.action != "pause":
            break
        assert event.rule == "search_failures" and event.values[OUTAGE] == now
        waits.append(event.values[RETRY_IN])
        now += event.values[RETRY_IN]
    # 15 s doubling to 300 s; the last wait ends exactly at the limit, and the try there that fails again stops
    assert waits == [15, 30, 60, 120, 240] + [300] * 10 + [135]
    assert event.action == "stop" and event.rule == "search_failures" and event.values[OUTAGE] == 3600
    assert "16 of 16 search calls failed" in event.message and "127.0.0.1:9/retrieve" in event.message
    assert "the fault has lasted 60 min, past --health-max-outage-hours 1" in event.message


def test_a_pause_says_what_failed_how_long_it_has_lasted_when_it_retries_and_the_limit():
    guard = HealthGuard(HealthConfig())
    guard.check_rollout(3, FAILING, SEARCH_ERROR, 100.0)
    [event] = guard.check_rollout(3, FAILING, SEARCH_ERROR, 115.0)
    assert event.message == (
        "step 3: 16 of 16 search calls failed (rate 1.000 > --max-search-failure-rate 0.05); first: "
        "http://127.0.0.1:9/retrieve: search failed after 1 attempts: ClientConnectorError; the step is not trained: "
        "waiting 30 s and trying again (try 3; the fault has lasted 15 s so far, the run stops past "
        "--health-max-outage-hours 6)"
    )
    assert event.values == {"failures": 16, "calls": 16, "rate": 1.0, OUTAGE: 15.0, "limit_s": 21600.0, RETRY_IN: 30}


def test_a_rollout_that_succeeds_ends_the_fault_and_the_next_one_starts_afresh():
    guard = HealthGuard(HealthConfig(max_outage_hours=0.1))  # 6 minutes
    for now in (0.0, 15.0, 45.0, 105.0):
        guard.check_rollout(1, FAILING, SEARCH_ERROR, now)
    assert guard.check_rollout(1, rollout(search_calls=16), {}, 225.0) == []  # back: the step trains
    [event] = guard.check_rollout(2, FAILING, SEARCH_ERROR, 300.0)  # 300 s after the first fault began: a new one
    assert event.action == "pause" and event.values[OUTAGE] == 0 and event.values[RETRY_IN] == 15
    [event] = guard.check_rollout(2, FAILING, SEARCH_ERROR, 660.0)
    assert event.action == "stop" and event.values[OUTAGE] == 360


def test_no_wait_at_all_with_a_limit_of_0_hours():
    [event] = HealthGuard(HealthConfig(max_outage_hours=0)).check_rollout(0, FAILING, SEARCH_ERROR, 5.0)
    assert event.action == "stop" and event.values[OUTAGE] == 0


def test_rewards_that_failed_for_a_passing_fault_pause_and_a_plugins_bug_stops():
    transient = {"reward_error_transient": "reward plugin m.judge raised on sample 0: ClientConnectorError: refused"}
    bug = {"reward_error": "reward plugin m.judge raised on sample 1: KeyError: 'target'"}
    [event] = HealthGuard(HealthConfig()).check_rollout(
        4, rollout(reward_errors=64, **{"rollout/reward_errors_transient": 64.0}), transient, 0.0
    )
    assert event.action == "pause" and event.rule == "reward_errors" and "64 for a fault that passes" in event.message
    assert "ClientConnectorError: refused" in event.message and event.values[RETRY_IN] == 15
    # one bug among the timeouts is a bug: it would come back on every try
    mixed = rollout(reward_errors=64, **{"rollout/reward_errors_transient": 63.0})
    [event] = HealthGuard(HealthConfig()).check_rollout(4, mixed, {**transient, **bug}, 0.0)
    assert event.action == "stop" and "KeyError: 'target'" in event.message
    # tolerated by rate: the passing share below it only warns, above it pauses although the bugs alone are tolerated
    tolerant = HealthGuard(HealthConfig(max_reward_error_rate=0.1))
    assert tolerant.check_rollout(4, rollout(reward_errors=4), bug, 0.0)[0].action == "warn"
    some = rollout(reward_errors=12, **{"rollout/reward_errors_transient": 8.0})
    assert tolerant.check_rollout(4, some, {**transient, **bug}, 0.0)[0].action == "pause"


def test_a_full_disk_at_a_save_pauses_until_a_save_succeeds():
    guard = HealthGuard(HealthConfig(max_outage_hours=0.01))  # 36 s
    [event] = guard.check_save(20, "the disk of --save /runs/x has no room for it", 0.0)
    assert (event.step, event.action, event.rule) == (19, "pause", "disk_full")
    assert event.message.startswith("saving the checkpoint of step 20: the disk of --save /runs/x has no room")
    assert guard.check_save(20, None, 15.0) == []
    assert guard.check_save(40, "full", 100.0)[0].values[OUTAGE] == 0  # a new fault
    assert guard.check_save(40, "full", 136.0)[0].action == "stop"


def test_the_outage_limit_is_a_flag_of_its_own():
    import argparse

    from slime_search.health.config import add_health_arguments, health_config

    parser = argparse.ArgumentParser()
    add_health_arguments(parser)
    assert health_config(parser.parse_args([])).max_outage_s == 6 * 3600
    assert health_config(parser.parse_args(["--health-max-outage-hours", "0.5"])).max_outage_s == 1800
    with pytest.raises(SystemExit):
        parser.parse_args(["--health-max-outage-hours", "-1"])


# ---- what passes: real clients, real servers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def services():
    """Reward services answering 503, 429 and 404 to every /score, and a port nothing listens on."""
    started = [ServerProcess([str(SERVICE), "--status", str(status)]) for status in (503, 429, 404)]
    try:
        yield {status: process.url for status, process in zip((503, 429, 404), started, strict=True)}
    finally:
        for process in started:
            process.stop()


def aiohttp_error(url: str, timeout_s: float = 5.0) -> BaseException:
    async def call():
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.post(f"{url}/score", json={}) as answer,
        ):
            answer.raise_for_status()

    try:
        asyncio.run(call())
    except Exception as err:  # noqa: BLE001 - the error is what the test looks at
        return err
    raise AssertionError("the call succeeded")


def httpx_error(url: str, timeout_s: float = 5.0) -> BaseException:
    try:
        httpx.post(f"{url}/score", json={}, timeout=timeout_s).raise_for_status()
    except Exception as err:  # noqa: BLE001
        return err
    raise AssertionError("the call succeeded")


@pytest.fixture
def silent_server():
    """A socket that accepts connections and never answers: a service too slow for its client's timeout."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_service_down_overloaded_or_too_slow_is_a_fault_that_passes(services, silent_server):
    down = f"http://127.0.0.1:{free_port()}"
    for client in (aiohttp_error, httpx_error):
        assert is_transient(client(down)), client  # connection refused
        assert is_transient(client(services[503])) and is_transient(client(services[429]))
        assert is_transient(client(silent_server, timeout_s=0.5))  # a timeout
        assert not is_transient(client(services[404]))  # the request is wrong: it would be refused again


def test_a_bug_is_no_passing_fault_and_a_plugin_may_say_which_it_raised():
    assert not is_transient(TypeError("unsupported operand")) and not is_transient(KeyError("target"))
    assert not is_transient(ValueError("could not convert string to float: 'yes'"))

    class JudgeBusy(RuntimeError):
        transient = True

    class QuotaGone(RuntimeError):
        transient = False

    assert is_transient(JudgeBusy("try later")) and not is_transient(QuotaGone("the key's credit is spent"))
    try:
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError as err:
            raise RuntimeError("judge call failed") from err
    except RuntimeError as wrapped:
        assert is_transient(wrapped)  # along the chain of causes


def test_a_full_disk_is_found_behind_the_errors_that_carry_it():
    from torch.distributed.checkpoint import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("Worker failure") from err
    except RuntimeError as wrapped:
        assert disk_full_error(wrapped) is full
    gathered = CheckpointException("write", {1: (OSError(errno.EDQUOT, "Disk quota exceeded"), None)})
    assert disk_full_error(gathered).errno == errno.EDQUOT
    assert disk_full_error(OSError(errno.EACCES, "Permission denied")) is None and disk_full_error(KeyError()) is None


# ---- the rollout: a reward plugin that calls a service ------------------------------------------------------------


def rollout_against(reward: str, reward_url: str):
    """A rollout of 2 prompts x 2 samples with the answer-only plugin and `reward` (outage_plugins) calling
    `reward_url`: its metrics and first errors, as the manager hands them to the guard."""
    from slime_search.plugins import load_function
    from slime_search.rollout.data_source import DataConfig, DataSource
    from slime_search.rollout.rollout import RolloutConfig, first_errors, generate_rollout

    rows = [{"prompt": f"where does otter {i} live", "reward_model": {"target": ["valley"]}, "extra_info": {"index": i}}
            for i in range(2)]  # fmt: skip
    source = DataSource(DataConfig(path="rows"), rows=rows)
    generate, score = (load_function(f"tests.health.outage_plugins.{name}") for name in ("answer_only", reward))
    groups, metrics = asyncio.run(
        generate_rollout(
            Namespace(reward_url=f"{reward_url}/score"), source, RolloutConfig(batch_size=2, n_samples_per_prompt=2),
            generate, score, {},
        )
    )  # fmt: skip
    return metrics, first_errors([s for g in groups for s in g])


def test_a_reward_service_that_is_down_pauses_the_step_and_a_reward_bug_stops_it(services):
    port = free_port()
    metrics, errors = rollout_against("service_reward", f"http://127.0.0.1:{port}")
    assert metrics["rollout/reward_errors"] == 4 and metrics["rollout/reward_errors_transient"] == 4
    assert "ClientConnectorError" in errors["reward_error_transient"] and "reward_error" not in errors
    [event] = HealthGuard(HealthConfig()).check_rollout(0, metrics, errors, 0.0)
    assert event.action == "pause" and event.rule == "reward_errors"
    with ServerProcess([str(SERVICE), "--port", str(port)]):  # the service is back, on its address
        metrics, errors = rollout_against("service_reward", f"http://127.0.0.1:{port}")
    assert metrics["rollout/reward_errors"] == 0 and metrics["rollout/trainable"] == 4 and errors == {}
    metrics, errors = rollout_against("buggy_reward", services[503])
    assert metrics["rollout/reward_errors"] == 4 and metrics["rollout/reward_errors_transient"] == 0
    [event] = HealthGuard(HealthConfig()).check_rollout(0, metrics, errors, 0.0)
    assert event.action == "stop" and "KeyError: 'no such key'" in event.message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
