"""Engine faults cost trajectories, not rollouts: transient faults are re-sent within a bound, a frozen engine fails
after --engine-timeout, a trajectory whose engine is gone ends ABORTED with the reason, and a rollout fails only when
no trajectory found an engine."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from slime_search.engines.client import EngineClient, EngineClientConfig, EngineError
from slime_search.rollout.sample_metrics import rollout_metrics
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import close_resources, generate
from slime_search.search_r1.prompt import make_prompt
from slime_search.types import Sample, Status
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def flaky():
    argv = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    with ServerProcess(argv) as process:
        yield process


def call(url: str, input_ids: list[int], **config):
    async def run():
        client = EngineClient(EngineClientConfig(url, backoff_s=0.01, **config))
        try:
            return await client.generate({"max_new_tokens": 1}, input_ids=input_ids)
        finally:
            await client.close()

    return asyncio.run(run())


def calls(flaky, input_ids: list[int]) -> int:
    return httpx.get(f"{flaky.url}/generate_calls").json().get(",".join(map(str, input_ids)), 0)


def test_a_transient_fault_is_re_sent_within_the_bound(flaky):
    assert call(flaky.url, [503, 2, 1], generate_retries=2)["output_ids"] == [7]
    assert calls(flaky, [503, 2, 1]) == 3
    with pytest.raises(EngineError, match="attempt 2") as failed:
        call(flaky.url, [502, 5, 2], generate_retries=1)
    assert failed.value.status == 502 and calls(flaky, [502, 5, 2]) == 2


def test_a_refused_request_is_never_re_sent(flaky):
    for status in (400, 500):
        with pytest.raises(EngineError) as failed:
            call(flaky.url, [status, 0, 3], generate_retries=3)
        assert failed.value.status == status and calls(flaky, [status, 0, 3]) == 1


def test_an_engine_that_is_gone_costs_the_retries_then_fails():
    start = time.perf_counter()
    with pytest.raises(EngineError, match="attempt 3"):
        call("http://127.0.0.1:9", [1, 2], generate_retries=2)
    assert time.perf_counter() - start < 5


@pytest.mark.slow
def test_a_frozen_engine_fails_after_the_timeout_without_a_retry(tiny_checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess(argv) as engine:
        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            start = time.perf_counter()
            with pytest.raises(EngineError, match="no answer within 2 s") as failed:
                call(engine.url, [1, 2, 3], timeout_s=2.0, generate_retries=3)
            elapsed = time.perf_counter() - start
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
    assert failed.value.timed_out and 2.0 <= elapsed < 3.5  # one bound, not four


def test_a_trajectory_whose_engine_is_gone_ends_aborted_with_the_reason(tiny_checkpoint):
    args = search_r1_args(
        engine_url="http://127.0.0.1:9", hf_checkpoint=str(tiny_checkpoint), engine_retries=1, apply_chat_template=True
    )

    async def go():
        samples = [Sample(prompt=make_prompt("who is the red otter")) for _ in range(3)]
        try:
            return await asyncio.gather(*(generate(args, s, {"max_new_tokens": 4}) for s in samples))
        finally:
            await close_resources()

    samples = asyncio.run(go())
    assert all(s.status is Status.ABORTED and not s.trainable for s in samples)
    assert all(s.metadata["finish_reason"] == "engine_error" and "attempt 2" in s.metadata["error"] for s in samples)
    assert rollout_metrics(samples)["rollout/engine_errors"] == 3
    # every trajectory lost its engine: the step trains on nothing and is skipped with the engines' error (they are
    # restarted after the rollout; too many such steps in a row stop the run)
    from slime_search.health.config import HealthConfig
    from slime_search.health.guard import HealthGuard
    from slime_search.rollout.rollout import batch_metrics, first_errors

    metrics = batch_metrics([samples], 0, "score")
    [event] = HealthGuard(HealthConfig()).check_rollout(4, metrics, first_errors(samples))
    assert event.action == "skip" and event.rule == "no_trainable_sample"
    assert "engine_error: " in event.message and "attempt 2" in event.message
