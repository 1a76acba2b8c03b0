"""The CPU engine server beyond the contract it shares with SGLang (tests/engines/test_engine_contract.py): batching,
its input checks (where SGLang would crash or silently ignore), and refusing a checkpoint of another shape."""

import asyncio
import time

import httpx
import pytest
import torch

from slime_search.engines.client import EngineClient, EngineClientConfig, EngineError
from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
from slime_search.utils.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess(
        [*argv, "--max-wait-ms", "50", "--weight-version", "0"], health_path="/health_generate"
    ) as process:
        process.model_path = str(tiny_checkpoint)
        yield process


def engine_state(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=30).json()["internal_states"][0]


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
    before = engine_state(server)

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
    after = engine_state(server)
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


def test_a_seeded_request_samples_the_same_tokens_alone_or_batched_with_others(server):
    """sampling_seed makes a trajectory's tokens independent of what the engine batched it with, as SGLang's seeded
    (deterministic) sampling does: rollouts are reproducible however requests arrive."""
    seeded = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 1234}
    prompt = [9707, 1879, 0]

    async def fire(bodies):
        client = EngineClient(EngineClientConfig(server.url))
        try:
            return await asyncio.gather(*(client.generate(params, input_ids=ids) for params, ids in bodies))
        finally:
            await client.close()

    alone = asyncio.run(fire([(seeded, prompt)]))[0]
    others = [({"temperature": 1.0, "max_new_tokens": 12}, list(range(100, 100 + n))) for n in (3, 9, 17)]
    for bodies in ([*others, (seeded, prompt)], [(seeded, prompt), *others]):
        before = engine_state(server)["batches"]
        crowd = asyncio.run(fire(bodies))
        assert engine_state(server)["batches"] - before < 4  # batched together
        ours = crowd[-1] if bodies[-1][0] is seeded else crowd[0]
        assert ours["output_ids"] == alone["output_ids"]
    unseeded = [asyncio.run(fire([({"temperature": 1.0, "max_new_tokens": 12}, prompt)]))[0] for _ in range(3)]
    assert any(out["output_ids"] != alone["output_ids"] for out in unseeded)  # the seed, not luck, fixed the draw


def test_text_input_and_length_finish(server):
    out = generate(server, text="Hello world", sampling_params={"max_new_tokens": 5, "temperature": 1.0})
    assert out["meta_info"]["prompt_tokens"] == 2  # "Hello", " world"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)  # decoded once, at the end
    assert "output_token_logprobs" not in out["meta_info"]


@pytest.mark.parametrize(
    "body,message",
    [
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": [1], "text": "x"}, "Either text, input_ids"),
        ({"input_ids": [[1, 2]]}, "list of integers"),
        ({"input_ids": [10**7]}, "out of range"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, "exceeds the context"),
        ({"input_ids": [1], "stream": True}, "streaming"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "does not implement: ['min_p']"),
    ],
)
def test_bad_requests_get_400(server, body, message):
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_a_checkpoint_of_another_shape_is_refused_and_the_weights_stay(server, tiny_checkpoint, tmp_path):
    bigger = save_tiny_checkpoint(tmp_path / "wide", TinyQwenConfig(hidden_size=96))

    async def update(path):
        client = EngineClient(EngineClientConfig(server.url))
        try:
            return await client.update_weights_from_disk(str(path), weight_version="step-7")
        finally:
            await client.close()

    with pytest.raises(EngineError, match="different model config") as refused:
        asyncio.run(update(bigger))
    assert refused.value.status == 400
    assert httpx.get(f"{server.url}/model_info", timeout=30).json()["weight_version"] == "0"


def test_a_memory_release_while_a_request_runs_is_refused_and_the_engine_serves_on(server):
    """SGLang's whole process exits on a release while a request runs or waits; the CPU engine refuses it instead and
    keeps its memory. An abort naming no request is ignored (SGLang's), abort_all ends the running one and those
    waiting behind it."""
    import threading

    results = []
    sampling = {"max_new_tokens": 3000, "ignore_eos": True}
    workers = [
        threading.Thread(target=lambda: results.append(generate(server, input_ids=[7], sampling_params=sampling)))
        for _ in range(40)  # more than one batch (32): some wait in the queue
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    while httpx.post(f"{server.url}/flush_cache", timeout=30).status_code != 400:  # refused while busy
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = httpx.post(f"{server.url}/release_memory_occupation", json={"tags": None}, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "release_memory_occupation should be called only when server is idle."
    assert engine_state(server)["released_memory"] == []
    assert httpx.post(f"{server.url}/abort_request", json={}, timeout=30).status_code == 200
    time.sleep(0.5)
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 400  # still running
    assert httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
    for worker in workers:
        worker.join(timeout=120)
    assert len(results) == 40 and all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert httpx.post(f"{server.url}/flush_cache?timeout=5", timeout=30).text.startswith("Cache flushed.")
    assert generate(server, input_ids=[7], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
