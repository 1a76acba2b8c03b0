"""The emulated engine of the overlap benchmark: recorded turns at the pace of its GPU model, prefix-cache hits,
and a pause (retract) + weight push + continue that splits a generation between two versions, as SGLang does."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from benchmarks.harness.stand_in_engines.emulated import LAG_MADE_UP_S, EmulatedEngine, GpuTiming, Request
from slime_search.search_r1.prompt import make_prompt
from slime_search.utils.server_process import ServerProcess

pytestmark = pytest.mark.timeout(120)

LONG_TURN = "<think> " + "the red otter lives by the river " * 20 + "</think> <answer> the valley </answer>"


def test_decode_step_time_follows_the_gpu_model_between_and_beyond_its_points():
    timing = GpuTiming(itl=((1, 0.002), (8, 0.004), (64, 0.011)))
    assert timing.step_s(1) == 0.002 and timing.step_s(8) == 0.004
    assert timing.step_s(36) == pytest.approx(0.004 + 0.007 * 28 / 56)
    assert timing.step_s(120) == pytest.approx(0.011 + 0.007 * 56 / 56)  # the last slope, extended
    assert GpuTiming().step_s(512) == pytest.approx(47.41e-3 * 0.4, rel=1e-3)  # ML.Energy's 8B point, scaled to 3B


TEN_MS_A_TOKEN = GpuTiming(itl=((1, 0.01), (1024, 0.01)), prefill_tokens_per_s=1e12)


def submit(engine: EmulatedEngine, tokens: int) -> Request:
    """A request as `generate` queues it, without HTTP: `tokens` to decode."""
    loop = asyncio.get_running_loop()
    planned = {"output_ids": list(range(tokens)), "meta_info": {}}
    request = Request({"input_ids": [1, 2, 3]}, "q", planned, 3, loop.create_future(), loop.time())
    engine.waiting.append(request)
    engine.work.set()
    return request


async def with_scheduler(scenario, timing: GpuTiming = TEN_MS_A_TOKEN):
    engine = EmulatedEngine(None, {}, timing)
    task = asyncio.get_running_loop().create_task(engine.run())
    await asyncio.sleep(0)
    try:
        return engine, await scenario(engine)
    finally:
        task.cancel()


def test_a_lag_of_the_emulators_own_event_loop_is_made_up_by_the_steps_after_it():
    """SGLang's scheduler does not wait for its HTTP front end; the emulator's one event loop does, so the GPU's clock
    makes up what the front end held it back (here a 0.3 s block, as parsing a burst of requests is)."""

    async def scenario(engine):
        loop = asyncio.get_running_loop()
        request = submit(engine, 100)
        await asyncio.sleep(0.2)
        time.sleep(0.3)  # the front end holds the loop
        await request.future
        return loop.time() - request.arrived

    engine, elapsed = asyncio.run(with_scheduler(scenario))
    assert 1.0 <= elapsed < 1.2  # 100 steps of 10 ms; without making up, 1.3 s
    assert engine.busy_s == pytest.approx(1.0) and engine.late_s < 0.05
    assert 0.25 < engine.max_lag_s <= LAG_MADE_UP_S


def test_a_request_that_arrives_during_a_lag_joins_no_step_before_it_arrived():
    async def scenario(engine):
        loop = asyncio.get_running_loop()
        first = submit(engine, 100)
        await asyncio.sleep(0.2)
        time.sleep(0.3)
        second = submit(engine, 10)  # arrives with the clock 0.3 s behind
        await second.future
        took = loop.time() - second.arrived
        await first.future
        return took

    _, took = asyncio.run(with_scheduler(scenario))
    assert took >= 0.095  # its 10 steps after it arrived, not among the steps that made the lag up


def test_a_lag_beyond_what_is_made_up_is_counted_late():
    scale = 0.1  # 1 ms a step of wall time; the 0.15 s block is 1.5 emulated seconds

    async def scenario(engine):
        request = submit(engine, 300)
        await asyncio.sleep(0.05)
        time.sleep(0.15)
        await request.future

    timing = GpuTiming(itl=((1, 0.01), (1024, 0.01)), prefill_tokens_per_s=1e12, time_scale=scale)
    engine, _ = asyncio.run(with_scheduler(scenario, timing))
    assert engine.late_s == pytest.approx(1.5 - LAG_MADE_UP_S, abs=0.15)
    assert engine.busy_s == pytest.approx(3.0)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("traj") / "t.jsonl"
    rows = [{"question": "where does the red otter live", "response": LONG_TURN}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    timing = json.dumps({"itl": [[1, 0.01], [1024, 0.01]], "push_s": 0.2})  # 10 ms a token, whatever the batch
    argv = ["-m", "benchmarks.harness.stand_in_engines.emulated", "--tokenizer", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--trajectories", str(path), "--timing", timing]) as process:
        yield process.url


def prompt_ids(tiny_checkpoint) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "user", "content": make_prompt("where does the red otter live")}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 500, "stop": ["</answer>"]}, "return_logprob": True}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_recorded_turn_takes_its_tokens_times_the_step_time(engine, tiny_checkpoint):
    ids = prompt_ids(tiny_checkpoint)
    started = time.monotonic()
    out = generate(engine, ids)
    elapsed = time.monotonic() - started
    n = len(out["output_ids"])
    assert out["text"].endswith("</answer>") and out["meta_info"]["finish_reason"]["matched"] == "</answer>"
    assert n > 100 and n * 0.01 <= elapsed < n * 0.01 + 2.0
    state = httpx.get(f"{engine}/server_info").json()["internal_states"][0]
    assert state["decoded_tokens"] >= n and state["busy_s"] >= n * 0.01


def test_a_pause_and_a_push_split_a_generation_between_two_versions(engine, tiny_checkpoint):
    ids = prompt_ids(tiny_checkpoint)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=generate(engine, ids)))
    worker.start()
    time.sleep(0.4)  # about 40 of its 100+ tokens decoded
    assert httpx.post(f"{engine}/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
    version = httpx.get(f"{engine}/model_info").json()["weight_version"]
    pushed = str(int(version) + 1)
    answer = httpx.post(f"{engine}/update_weights_from_disk", json={"model_path": "-", "weight_version": pushed})
    assert answer.json()["success"] and httpx.get(f"{engine}/model_info").json()["weight_version"] == pushed
    httpx.post(f"{engine}/continue_generation", json={})
    worker.join(timeout=60)
    meta = result["out"]["meta_info"]
    n = len(result["out"]["output_ids"])
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [version, pushed] and meta["weight_version"] == pushed
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    assert 10 < spans[0]["end"] < n - 10


def test_idle_time_is_counted_and_split_by_whether_it_follows_a_weight_update(engine, tiny_checkpoint):
    """Where the engine was not busy: a gap with nothing to decode counts as idle, and as idle after an update when it
    began within a second of one ending (the next batch not yet there); a pause is not idle."""
    ids = prompt_ids(tiny_checkpoint)

    def state():
        return httpx.get(f"{engine}/server_info").json()["internal_states"][0]

    generate(engine, ids)
    time.sleep(0.3)  # idle, long after any update
    version = int(httpx.get(f"{engine}/model_info").json()["weight_version"]) + 1
    httpx.post(f"{engine}/update_weights_from_disk", json={"model_path": "-", "weight_version": str(version)})
    before = state()
    time.sleep(0.5)  # idle, just after the update
    generate(engine, ids)
    began = time.monotonic()  # the idle gap from here is counted below; only the reply's own transfer is not timed
    after_update = state()
    gap = after_update["idle_s"] - before["idle_s"]
    assert 0.5 <= gap < 1.5 and before["idle_s"] >= 0.3
    assert after_update["idle_after_update_s"] - before["idle_after_update_s"] == pytest.approx(gap, abs=1e-9)
    httpx.post(f"{engine}/pause_generation", json={"mode": "retract"})
    time.sleep(0.3)
    httpx.post(f"{engine}/continue_generation", json={})
    generate(engine, ids)
    last = state()
    wall = time.monotonic() - began
    paused = last["paused_s"] - after_update["paused_s"]
    idle = last["idle_s"] - after_update["idle_s"]
    busy = last["busy_s"] - after_update["busy_s"]
    assert 0.3 <= paused <= wall  # the 0.3 s asleep are paused ...
    # ... and not idle too: the requests' own latency may count as idle, but never the pause a second time
    assert idle + paused + busy <= wall + 0.15
    assert last["late_s"] < 0.5 * last["busy_s"]  # one request at a time: the steps keep to the model
    # every moment of the engine is one of the four (the gap it is in now, a few milliseconds, not yet counted)
    parts = last["busy_s"] + last["idle_s"] + last["paused_s"] + last["late_s"]
    assert parts == pytest.approx(last["emulated_s"], abs=1.0)


def test_the_same_context_gets_the_same_turn_under_the_version_served_then(engine, tiny_checkpoint):
    """A question's samples ask with one context: the emulator works its answer out once and serves it again, each
    time stamped with the version it serves then (the answer it keeps is not changed by a request that used it)."""
    ids = prompt_ids(tiny_checkpoint)
    first = generate(engine, ids)
    version = httpx.get(f"{engine}/model_info").json()["weight_version"]
    pushed = str(int(version) + 1)
    httpx.post(f"{engine}/update_weights_from_disk", json={"model_path": "-", "weight_version": pushed})
    second = generate(engine, ids)
    assert second["output_ids"] == first["output_ids"] and second["text"] == first["text"]
    assert first["meta_info"]["weight_versions"] == [{"version": version, "start": 0, "end": len(first["output_ids"])}]
    assert second["meta_info"]["weight_version"] == pushed
    assert second["meta_info"]["weight_versions"] == [{"version": pushed, "start": 0, "end": len(second["output_ids"])}]


def test_an_unknown_question_is_refused(engine):
    response = httpx.post(f"{engine}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {}}, timeout=30)
    assert response.status_code == 400


def test_nothing_left_running_after_the_tests(engine):
    state = asyncio.run(asyncio.to_thread(lambda: httpx.get(f"{engine}/server_info").json()))["internal_states"][0]
    assert state["running"] == 0 and state["waiting"] == 0
