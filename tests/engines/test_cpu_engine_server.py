"""The CPU engine behind SGLang's HTTP API, as a real server process on 127.0.0.1."""

import asyncio
import threading

import httpx
import pytest
import torch

from slime_search.engines.client import EngineClient, EngineClientConfig, EngineError
from slime_search.models.tiny_qwen import TinyQwen2Config, save_tiny_checkpoint
from slime_search.utils.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--max-wait-ms", "50"], health_path="/health_generate") as process:
        process.model_path = str(tiny_checkpoint)
        yield process


def generate(server, **body):
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def reference_log_probs(checkpoint, prompt, output, temperature):
    """A fresh transformers forward over prompt + output: log softmax(logits / T) at each generated token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    log_probs = torch.log_softmax(logits / (temperature or 1.0), -1)
    return [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def test_concurrent_requests_are_batched_and_log_probs_match_a_fresh_forward(server, tiny_checkpoint):
    prompts = [[9707, 1879, 0], list(range(100, 117)), [151644, 872, 198, 14623, 30], [42]]
    temperatures = [1.0, 0.7, 0.0, 1.0]
    before = httpx.get(f"{server.url}/health").json()

    async def fire():
        client = EngineClient(EngineClientConfig(server.url))
        try:
            return await asyncio.gather(
                *(
                    client.generate({"temperature": t, "max_new_tokens": 12}, input_ids=p)
                    for p, t in zip(prompts, temperatures, strict=True)
                )
            )
        finally:
            await client.close()

    outputs = asyncio.run(fire())
    after = httpx.get(f"{server.url}/health").json()
    assert after["requests"] - before["requests"] == 4
    assert after["batches"] - before["batches"] < 4  # shared forward passes, not one request at a time
    for prompt, temperature, out in zip(prompts, temperatures, outputs, strict=True):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(out["output_ids"])
        logprobs = meta["output_token_logprobs"]
        assert [tok for _, tok, _ in logprobs] == out["output_ids"]
        expected = reference_log_probs(tiny_checkpoint, prompt, out["output_ids"], temperature)
        # float32, left-padded batch vs a lone unpadded forward: agreement to 1e-4 nats
        assert max(abs(lp - e) for (lp, _, _), e in zip(logprobs, expected, strict=True)) < 1e-4


def test_text_input_and_length_finish(server):
    out = generate(server, text="Hello world", sampling_params={"max_new_tokens": 5, "temperature": 1.0})
    assert out["meta_info"]["prompt_tokens"] == 2  # "Hello", " world"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)  # decoded once, at the end
    assert "output_token_logprobs" not in out["meta_info"]


def test_stop_strings_trim_unless_no_stop_trim_and_stop_token_ids(server):
    greedy = {"temperature": 0, "max_new_tokens": 12, "skip_special_tokens": False}
    full = generate(server, input_ids=[9707, 1879, 0], sampling_params=greedy)
    text, ids = full["text"], full["output_ids"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    trimmed = generate(server, input_ids=[9707, 1879, 0], sampling_params={**greedy, "stop": [stop]})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[: text.find(stop)]
    assert trimmed["output_ids"] == ids[: len(trimmed["output_ids"])]
    kept = generate(server, input_ids=[9707, 1879, 0], sampling_params={**greedy, "stop": [stop], "no_stop_trim": True})
    assert stop in kept["text"] and kept["output_ids"] == trimmed["output_ids"]
    by_id = generate(server, input_ids=[9707, 1879, 0], sampling_params={**greedy, "stop_token_ids": [ids[2]]})
    assert by_id["output_ids"][-1] == ids[2] and by_id["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": ids[2],
    }


@pytest.mark.parametrize(
    "body,message",
    [
        ({"sampling_params": {}}, "exactly one of 'input_ids' or 'text'"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": []}, "prompt is empty"),
        ({"input_ids": [[1, 2]]}, "list of integers"),
        ({"input_ids": [10**7]}, "out of range"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, "exceeds the context"),
        ({"input_ids": [1], "stream": True}, "streaming"),
    ],
)
def test_bad_requests_get_400(server, body, message):
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_abort_request_stops_a_running_generation(server):
    result = {}

    def long_request():
        result["out"] = generate(
            server, input_ids=[1, 2, 3], rid="long-1", sampling_params={"max_new_tokens": 3000, "ignore_eos": True}
        )

    started = httpx.get(f"{server.url}/health").json()["requests"]
    worker = threading.Thread(target=long_request)
    worker.start()
    for _ in range(300):  # wait until the engine has taken the request into a batch
        if httpx.get(f"{server.url}/health").json()["requests"] > started:
            break
        threading.Event().wait(0.05)
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "long-1"}).status_code == 200
    worker.join(timeout=120)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 3000


def test_update_weights_from_disk_changes_what_is_served(server, tiny_checkpoint, tmp_path):
    other = save_tiny_checkpoint(tmp_path / "seed1", TinyQwen2Config(seed=1))
    greedy = {"temperature": 0, "max_new_tokens": 6}
    before = generate(server, input_ids=[9707, 1879], sampling_params=greedy, return_logprob=True)
    version = httpx.get(f"{server.url}/get_model_info").json()["weight_version"]

    async def update(path):
        client = EngineClient(EngineClientConfig(server.url))
        try:
            return await client.update_weights_from_disk(str(path), weight_version="step-7")
        finally:
            await client.close()

    def log_probs(out):
        return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    try:
        assert asyncio.run(update(other)) == {"success": True, "message": f"loaded {other}", "weight_version": "step-7"}
        after = generate(server, input_ids=[9707, 1879], sampling_params=greedy, return_logprob=True)
        assert after["meta_info"]["weight_version"] == "step-7" != version
        expected = reference_log_probs(other, [9707, 1879], after["output_ids"], 0)
        assert max(abs(a - b) for a, b in zip(log_probs(after), expected, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(log_probs(after), log_probs(before), strict=False)) > 1e-3
        bigger = save_tiny_checkpoint(tmp_path / "wide", TinyQwen2Config(hidden_size=96))
        with pytest.raises(EngineError, match="different model config"):
            asyncio.run(update(bigger))
    finally:
        asyncio.run(update(tiny_checkpoint))
