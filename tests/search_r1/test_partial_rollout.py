"""A trajectory interrupted by a weight push (partial rollout): the real plugin against the CPU engine, paused while
it decodes, given other weights and continued. The trajectory finishes with tokens from two versions; each token's
log-prob is the one it was sampled with (that version's, conditioned on everything before it); and the importance
weights the trainer computes compare each token with its own behaviour log-prob."""

import asyncio

import httpx
import pytest
import torch

from slime_search.algo.importance import vanilla_tis_weights
from slime_search.engines.client import call_engine
from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
from slime_search.rollout.sample_metrics import staleness_metrics
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import close_resources, generate, session_for
from slime_search.search_r1.prompt import make_prompt
from slime_search.types import Sample, TrainSample
from slime_search.utils.server_process import ServerProcess
from slime_search.weight_sync.disk import update_engines_from_disk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def log_probs_under(checkpoint, tokens: list[int], response_length: int) -> torch.Tensor:
    """The log-prob of every response token under `checkpoint` (temperature 1), as the trainer recomputes them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    start = len(tokens) - response_length
    return torch.stack([log_probs[start - 1 + i, tokens[start + i]] for i in range(response_length)])


def test_a_trajectory_interrupted_by_a_push_keeps_each_tokens_version_and_behaviour_log_prob(tiny_checkpoint, tmp_path):
    pushed = save_tiny_checkpoint(tmp_path / "pushed", TinyQwenConfig(seed=1))  # the weights of version 1
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--weight-version", "0"]) as engine:
        args = search_r1_args(
            engine_url=engine.url,
            hf_checkpoint=str(tiny_checkpoint),
            search_url="http://127.0.0.1:9/retrieve",  # never reached: one answer-only turn
            max_turns=0,
            apply_chat_template=True,
        )

        async def interrupted_rollout() -> Sample:
            sample = Sample(prompt=make_prompt("where does the red otter live"))
            params = {"max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True}
            task = asyncio.ensure_future(generate(args, sample, params))
            while not session_for(args).resources.engines.in_flight[engine.url]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # decoding (600 tokens take a few seconds here)
            assert not task.done()
            await call_engine(engine.url, "pause_generation", "retract")
            assert await update_engines_from_disk([engine.url], str(pushed), "1") == ["1"]
            await call_engine(engine.url, "continue_generation")
            try:
                return await task
            finally:
                await close_resources()

        sample = asyncio.run(interrupted_rollout())
        assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == "1"

    versions = sample.generated_versions()
    cut = versions.index(1)
    assert sample.trainable and len(versions) == sample.response_length == 600
    assert 0 < cut < 600 and versions == [0] * cut + [1] * (600 - cut)
    assert staleness_metrics([sample], trainer_version=1)["async/interrupted_trajectories"] == 1

    # each token's behaviour log-prob is its own version's, given every token before it
    behaviour = torch.tensor(sample.rollout_log_probs)
    under_old = log_probs_under(tiny_checkpoint, sample.tokens, sample.response_length)
    under_new = log_probs_under(pushed, sample.tokens, sample.response_length)
    assert torch.allclose(behaviour[:cut], under_old[:cut], atol=1e-4)
    assert torch.allclose(behaviour[cut:], under_new[cut:], atol=1e-4)

    # the trainer (policy at version 1) weights each token against the policy that produced it: tokens version 1
    # generated weigh 1, the older ones exp(new - old)
    train = TrainSample.from_sample(sample)
    weights = vanilla_tis_weights(under_new, torch.tensor(train.rollout_log_probs), cap=1e6)
    assert torch.allclose(weights[cut:], torch.ones(600 - cut), atol=1e-3)
    assert torch.allclose(weights[:cut], torch.exp(under_new[:cut] - under_old[:cut]), rtol=1e-3)
    assert not torch.allclose(weights[:cut], torch.ones(cut), atol=1e-2)  # the two versions differ
