"""The engine contract: the same assertions against real SGLang (on CPU) and the CPU engine server.

What the client, the generate plugin and weight sync rely on: /generate's ids, log-probs and finish reasons, the
served weight version in /model_info, the disk, tensor and broadcast weight updates (the latter two only inside
SGLang's weight-update session), and the bodies of the control endpoints (empty, plain text, JSON null). The CPU engine
must answer as the pinned SGLang does; where it does not, a test here fails for it alone.
"""

import asyncio
import threading
import time

import httpx
import pytest
import torch

from slime_search.engines.client import (
    EngineClient,
    EngineClientConfig,
    EngineError,
    IdleWait,
    call_engine,
    release_memory_when_idle,
)
from slime_search.engines.cpu_engine_server import FLUSHED, SGLANG_VERSION
from slime_search.engines.weight_wire import serialize_named_tensors
from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
from slime_search.utils.net import free_port
from slime_search.utils.server_process import ServerProcess
from slime_search.weight_sync.broadcast import BroadcastConfig, WeightBroadcaster
from slime_search.weight_sync.transport_base import weight_update_session
from tests.conftest import REPO_ROOT, reset_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PROMPT = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def cpu_engine_url(tiny_checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--weight-version", "0"], health_path="/health_generate") as process:
        yield process.url


@pytest.fixture(params=["cpu_engine", pytest.param("sglang", marks=pytest.mark.session_engine)])
def engine(request, tiny_checkpoint) -> str:
    """An engine serving the tiny checkpoint at weight version "0"."""
    url = request.getfixturevalue("cpu_engine_url") if request.param == "cpu_engine" else None
    if url is None:
        url = request.getfixturevalue("sglang_engine").url
    reset_engine(url, tiny_checkpoint)
    return url


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The tiny architecture with other weights: what a trainer pushes."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("seed1"), TinyQwenConfig(seed=1))


def generate(url: str, **body) -> dict:
    response = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def hf_log_probs(checkpoint, prompt: list[int], output: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0], -1)
    return [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def served_log_probs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_pinned_sglang_is_the_version_the_cpu_engine_answers_as():
    pins = dict(line.split("==") for line in (REPO_ROOT / "constraints-gpu.txt").read_text().split() if "==" in line)
    assert pins["sglang"] == SGLANG_VERSION


def test_generate_answers_ids_log_probs_and_finish_reason(engine, tiny_checkpoint):
    out = generate(engine, sampling_params={"max_new_tokens": 8, "temperature": 1.0}, return_logprob=True)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(PROMPT), 8, "0")
    assert [token for _, token, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    # log-probs of the sampling distribution, exactly what the trainer recomputes: a float32 forward to 1e-4
    assert max_difference(served_log_probs(out), hf_log_probs(tiny_checkpoint, PROMPT, out["output_ids"])) < 1e-4
    assert "output_token_logprobs" not in generate(engine, sampling_params={"max_new_tokens": 2})["meta_info"]
    greedy = generate(engine, sampling_params={"max_new_tokens": 8, "temperature": 0.0})["output_ids"]
    assert greedy == hf_argmax_path(tiny_checkpoint, PROMPT, greedy)


def test_input_log_probs_are_teacher_forced_at_temperature_one_from_logprob_start_len(engine, tiny_checkpoint):
    """What the probe of the engines against the trainer reads (EngineClient.input_log_probs): with logprob_start_len
    0 and no token to generate, every input token's log-prob given those before it, the first one None; of the model's
    own distribution whatever temperature the request samples at (SGLang 0.5.23 divides only sampled tokens' logits
    by it)."""
    body = {"return_logprob": True, "logprob_start_len": 0}
    out = generate(engine, sampling_params={"max_new_tokens": 0, "temperature": 0.5}, **body)
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and [token for _, token, _ in entries] == PROMPT
    assert entries[0] == [None, PROMPT[0], None] and all(text is None for _, _, text in entries)
    forced = hf_log_probs(tiny_checkpoint, PROMPT[:1], PROMPT[1:])  # temperature 1
    assert max_difference([lp for lp, _, _ in entries[1:]], forced) < 1e-4
    # from a later token: none for the first of the range, the same values after it
    later = generate(engine, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=5)
    tail = later["meta_info"]["input_token_logprobs"]
    assert tail[0] == [None, PROMPT[5], None] and max_difference([lp for lp, _, _ in tail[1:]], forced[5:]) < 1e-4
    # by default none; beyond the prompt SGLang's 400
    default = generate(engine, sampling_params={"max_new_tokens": 1}, return_logprob=True)["meta_info"]
    assert default["input_token_logprobs"] == []
    too_far = httpx.post(f"{engine}/generate", json={"input_ids": PROMPT, **body, "logprob_start_len": 50}, timeout=60)
    assert too_far.status_code == 400
    assert too_far.json()["error"]["message"].startswith("req.logprob_start_len=50 is higher than the number of input")
    assert max_difference(asyncio.run(call_engine(engine, "input_log_probs", PROMPT)), forced) < 1e-4


def hf_argmax_path(checkpoint, prompt: list[int], output: list[int]) -> list[int]:
    """The most likely next token at each position of `output` (teacher-forced): greedy decoding must follow it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].argmax(-1).tolist()


def test_stop_strings_and_stop_tokens_end_with_the_stop_kept_in_ids_and_trimmed_from_text(engine):
    greedy = {"temperature": 0, "max_new_tokens": 8}
    ids = generate(engine, sampling_params=greedy)["output_ids"]
    stop_token = ids[2]
    by_id = generate(engine, sampling_params={**greedy, "stop_token_ids": [stop_token]})
    first = ids.index(stop_token)
    assert by_id["output_ids"] == ids[: first + 1]  # the stop token stays in the ids (aligned with log-probs)
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    kept = generate(engine, sampling_params={**greedy, "stop_token_ids": [stop_token], "no_stop_trim": True})
    assert kept["output_ids"] == by_id["output_ids"] and len(kept["text"]) > len(by_id["text"])
    stop_text = kept["text"][len(by_id["text"]) :]
    by_text = generate(engine, sampling_params={**greedy, "stop": [stop_text]})
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in by_text["text"] and by_text["output_ids"][-1] == stop_token
    kept_text = generate(engine, sampling_params={**greedy, "stop": [stop_text], "no_stop_trim": True})
    assert kept_text["text"].endswith(stop_text) and kept_text["output_ids"] == by_text["output_ids"]


def test_a_text_prompt_with_slimes_sampling_params_is_answered_as_by_token_ids(engine, tiny_checkpoint):
    """What a slime plugin sends (slime's generate_with_search): the prompt as text, with the sampling parameters
    slime builds (GenerateState.sampling_params: no_stop_trim, skip_special_tokens and
    spaces_between_special_tokens off, top_k -1, null stops)."""
    from transformers import AutoTokenizer

    slime_params = {
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None, "stop_token_ids": None,
        "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
    }  # fmt: skip
    text = AutoTokenizer.from_pretrained(tiny_checkpoint).decode(PROMPT)
    body = {"text": text, "sampling_params": slime_params, "return_logprob": True}
    by_text = httpx.post(f"{engine}/generate", json=body, timeout=300)
    assert by_text.status_code == 200, by_text.text
    out, by_ids = by_text.json(), generate(engine, sampling_params=slime_params, return_logprob=True)
    assert out["output_ids"] == by_ids["output_ids"] and len(out["output_ids"]) == 6
    assert out["meta_info"]["prompt_tokens"] == len(PROMPT) and isinstance(out["text"], str)


def test_model_info_serves_the_weight_version_and_server_info_the_sglang_version(engine):
    assert httpx.get(f"{engine}/model_info", timeout=30).json()["weight_version"] == "0"
    assert httpx.get(f"{engine}/server_info", timeout=30).json()["version"] == SGLANG_VERSION
    assert httpx.get(f"{engine}/get_weight_version", timeout=30).status_code == 404  # gone from SGLang
    assert asyncio.run(call_engine(engine, "weight_version")) == "0"
    assert asyncio.run(call_engine(engine, "version")) == SGLANG_VERSION


def test_update_weights_from_disk_answers_success_and_model_info_the_new_version(engine, other_checkpoint):
    answer = asyncio.run(call_engine(engine, "update_weights_from_disk", str(other_checkpoint), "7"))
    assert answer["success"] is True and answer["num_paused_requests"] == 0 and "weight_version" not in answer
    assert asyncio.run(call_engine(engine, "weight_version")) == "7"
    out = generate(engine, sampling_params={"max_new_tokens": 6, "temperature": 1.0}, return_logprob=True)
    assert out["meta_info"]["weight_version"] == "7"
    assert max_difference(served_log_probs(out), hf_log_probs(other_checkpoint, PROMPT, out["output_ids"])) < 1e-4
    unchanged = asyncio.run(call_engine(engine, "update_weights_from_disk", str(other_checkpoint)))
    assert unchanged["success"] and asyncio.run(call_engine(engine, "weight_version")) == "7"  # no version given


def tensor_update(url: str, named: list, version: str | None = None) -> httpx.Response:
    body = {"serialized_named_tensors": [serialize_named_tensors(named)], "load_format": None, "flush_cache": True}
    if version is not None:
        body["weight_version"] = version
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=300)


def hf_state(checkpoint) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_tensor_updates_must_sit_in_a_weight_update_session(engine, other_checkpoint):
    state = sorted(hf_state(other_checkpoint).items())
    refused = tensor_update(engine, state, "3")
    assert refused.status_code == 400
    assert refused.json() == {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
    }
    assert httpx.post(f"{engine}/end_weight_update", json={}, timeout=30).status_code == 400  # none is open
    with weight_update_session([engine]):
        assert httpx.post(f"{engine}/begin_weight_update", json={}, timeout=30).status_code == 400  # one is open
        half = len(state) // 2
        assert tensor_update(engine, state[:half]).json()["success"]
        assert asyncio.run(call_engine(engine, "weight_version")) == "0"  # a bucket without a version keeps it
        assert tensor_update(engine, state[half:], "3").json()["success"]
    assert asyncio.run(call_engine(engine, "weight_version")) == "3"
    out = generate(engine, sampling_params={"max_new_tokens": 6, "temperature": 1.0}, return_logprob=True)
    assert max_difference(served_log_probs(out), hf_log_probs(other_checkpoint, PROMPT, out["output_ids"])) < 1e-4


def test_broadcast_updates_over_gloo_inside_a_session_and_a_refused_bucket_fails_at_once(engine, other_checkpoint):
    state = {name: tensor for name, tensor in hf_state(other_checkpoint).items()}
    # group names are per process: one per engine, since a broken group keeps its name here
    refused = BroadcastConfig("gloo", bucket_bytes=1 << 20, group_name=f"refused-{engine[-5:]}", timeout_s=600)
    broadcaster = WeightBroadcaster(refused)
    broadcaster.connect([engine], [1], "127.0.0.1", free_port())
    try:
        started = time.monotonic()
        with pytest.raises(EngineError, match="must run between begin_weight_update"):
            broadcaster.push(state, "4")  # the engine refuses before receiving: no wait for a broadcast nobody takes
        assert time.monotonic() - started < 60 and broadcaster.broken
    finally:
        broadcaster.close()
    broadcaster = WeightBroadcaster(BroadcastConfig("gloo", bucket_bytes=1 << 20, group_name=f"again-{engine[-5:]}"))
    broadcaster.connect([engine], [1], "127.0.0.1", free_port())
    try:
        with weight_update_session([engine]):
            assert broadcaster.push(state, "4") == ["4"]
    finally:
        broadcaster.close()
    out = generate(engine, sampling_params={"max_new_tokens": 6, "temperature": 1.0}, return_logprob=True)
    assert out["meta_info"]["weight_version"] == "4"
    assert max_difference(served_log_probs(out), hf_log_probs(other_checkpoint, PROMPT, out["output_ids"])) < 1e-4


def test_control_endpoints_answer_sglangs_bodies_and_the_client_reads_each(engine):
    def call(method: str, path: str, body=None) -> httpx.Response:
        response = httpx.request(method, f"{engine}{path}", json=body, timeout=60)
        assert response.status_code == 200, (path, response.text)
        return response

    assert call("GET", "/health").text == "" and call("GET", "/health_generate").text == ""
    assert call("POST", "/flush_cache").text.startswith("Cache flushed.")
    assert call("POST", "/abort_request", {"rid": "nobody"}).text == ""
    assert call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).json() is None
    assert call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).json() is None

    async def through_the_client():
        client = EngineClient(EngineClientConfig(engine))
        try:
            return (
                await client.health(),
                await client.flush_cache(),
                await client.abort("nobody"),
                await client.release_memory(["kv_cache"]),
                await client.resume_memory(["kv_cache"]),
            )
        finally:
            await client.close()

    health, flushed, aborted, released, resumed = asyncio.run(through_the_client())
    assert health is None and flushed.startswith("Cache flushed.") and aborted is released is resumed is None
    assert generate(engine, sampling_params={"max_new_tokens": 2})["meta_info"]["weight_version"] == "0"


def test_abort_ends_a_running_generation_with_an_abort_finish_reason(engine):
    result = {}

    def long_request():
        sampling = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}
        result["out"] = generate(engine, rid="long-1", sampling_params=sampling)

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(3)  # the request is running (3000 tokens take far longer on this machine)
    assert asyncio.run(call_engine(engine, "abort", "long-1")) is None
    worker.join(timeout=300)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
    assert meta["finish_reason"]["message"] in ("Aborted", "Abort in waiting queue")


def start_generation(engine: str, max_new_tokens: int = 3000) -> tuple[threading.Thread, dict]:
    """A generation on a thread (3000 tokens run far longer than any test here waits); its answer lands in the dict."""
    result = {}
    sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    worker = threading.Thread(target=lambda: result.update(out=generate(engine, sampling_params=sampling)))
    worker.start()
    return worker, result


def flush(engine: str, timeout: float | None = None, method: str = "POST") -> httpx.Response:
    path = "/flush_cache" if timeout is None else f"/flush_cache?timeout={timeout}"
    return httpx.request(method, f"{engine}{path}", timeout=120)


def wait_busy(engine: str, worker: threading.Thread) -> None:
    """Until the engine has the request (an immediate flush is refused while a request runs or waits)."""
    deadline = time.monotonic() + 60
    while flush(engine).status_code != 400:
        assert worker.is_alive() and time.monotonic() < deadline, "the generation never ran"
        time.sleep(0.02)


def test_flush_cache_refuses_while_busy_and_waits_for_idle_within_its_timeout(engine):
    """SGLang 0.5.23's /flush_cache: 400 at once while a request runs; with ?timeout= it waits for idleness and
    answers 400 if it never comes; concurrent flushes are answered in turn."""
    idle = flush(engine, 5)
    assert (idle.status_code, idle.text) == (200, FLUSHED) and flush(engine, method="GET").status_code == 200
    negative = flush(engine, -1)  # the timeout is a non-negative number; SGLang answers 400 where FastAPI says 422
    assert negative.status_code == 400 and negative.json()["code"] == 400 and "timeout" in negative.json()["message"]
    worker, result = start_generation(engine)
    wait_busy(engine, worker)
    busy = flush(engine)
    assert (busy.status_code, busy.text) == (400, "Flush cache failed.\n")
    started = time.monotonic()
    timed_out = flush(engine, 1)
    assert (timed_out.status_code, timed_out.text) == (400, "Timed out waiting for idle state.")
    assert time.monotonic() - started >= 1.0
    answers = {}
    first = threading.Thread(target=lambda: answers.update(first=flush(engine, 120)))
    first.start()
    time.sleep(0.5)
    second = threading.Thread(target=lambda: answers.update(second=flush(engine, 120)))
    second.start()
    time.sleep(0.5)
    assert not answers  # both wait: the generation still runs
    assert asyncio.run(call_engine(engine, "abort")) is None  # abort_all
    for thread in (first, second, worker):
        thread.join(timeout=300)
    assert [(a.status_code, a.text) for a in (answers["first"], answers["second"])] == [(200, FLUSHED)] * 2
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_memory_release_during_a_generation_waits_for_it_then_aborts_it_and_the_engine_lives(engine):
    """SGLang ends its whole process on a release while a request runs: the release waits for idleness, and past
    its deadline aborts what is left first."""
    short_wait = IdleWait(deadline_s=2.0, abort_grace_s=120.0, flush_timeout_s=0.5)
    worker, result = start_generation(engine)
    wait_busy(engine, worker)
    asyncio.run(release_memory_when_idle(engine, ["kv_cache"], short_wait))
    worker.join(timeout=300)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    asyncio.run(call_engine(engine, "resume_memory", ["kv_cache"]))
    # a generation that ends within the deadline is waited for, not aborted
    worker, result = start_generation(engine, max_new_tokens=100)
    wait_busy(engine, worker)
    asyncio.run(release_memory_when_idle(engine, ["kv_cache"], IdleWait(deadline_s=120.0, flush_timeout_s=0.5)))
    worker.join(timeout=60)
    assert result["out"]["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
    asyncio.run(call_engine(engine, "resume_memory", ["kv_cache"]))
    assert generate(engine, sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_generation_retracted_by_a_pause_goes_on_under_the_pushed_weights_and_names_each_tokens_version(
    engine, tiny_checkpoint, other_checkpoint
):
    """What partial rollouts rely on: pause (retract) while a generation runs, update the weights, continue. The one
    answer holds every token, `weight_versions` says which version generated which, and each token's log-prob is that
    version's, conditioned on everything before it (the continuation is prefilled again under the new weights)."""
    result = {}

    def long_request():
        sampling = {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 1.0}
        result["out"] = generate(engine, sampling_params=sampling, return_logprob=True)

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(1.0)  # the request is decoding (1000 tokens take several seconds on either engine here)
    paused = httpx.post(f"{engine}/pause_generation", json={"mode": "retract"}, timeout=60)
    assert paused.status_code == 200 and paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    update = {"model_path": str(other_checkpoint), "weight_version": "1"}
    assert httpx.post(f"{engine}/update_weights_from_disk", json=update, timeout=300).json()["success"]
    resumed = httpx.post(f"{engine}/continue_generation", json={}, timeout=60)
    assert resumed.status_code == 200 and resumed.json()["status"] == "ok"
    worker.join(timeout=600)

    out = result["out"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 1000} and len(out["output_ids"]) == 1000
    spans = meta["weight_versions"]
    assert [span["version"] for span in spans] == ["0", "1"] and meta["weight_version"] == "1"
    cut = spans[0]["end"]
    assert spans == [{"version": "0", "start": 0, "end": cut}, {"version": "1", "start": cut, "end": 1000}]
    assert 0 < cut < 1000 and meta["num_retractions"] >= 1
    served = served_log_probs(out)
    before = hf_log_probs(tiny_checkpoint, PROMPT, out["output_ids"][:cut])
    after = hf_log_probs(other_checkpoint, PROMPT, out["output_ids"])[cut:]
    assert max_difference(served[:cut], before) < 1e-4 and max_difference(served[cut:], after) < 1e-4


def test_a_pause_holds_new_generations_until_continue(engine):
    assert httpx.post(f"{engine}/pause_generation", json={"mode": "retract"}, timeout=60).status_code == 200
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=generate(engine, sampling_params={"max_new_tokens": 2})))
    worker.start()
    worker.join(timeout=3)
    assert worker.is_alive() and not result  # waiting while paused
    assert httpx.post(f"{engine}/continue_generation", json={}, timeout=60).status_code == 200
    worker.join(timeout=300)
    assert result["out"]["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "body,error",
    [
        ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "unknown field `bogus`"),
        ({"input_ids": []}, {"message": "input_ids cannot be empty."}),
    ],
)
def test_bad_requests_get_sglangs_400(engine, body, error):
    response = httpx.post(f"{engine}/generate", json=body, timeout=60)
    assert response.status_code == 400
    answer = response.json()["error"]
    assert answer == error if isinstance(error, dict) else error in answer
