"""The probe of the engines against the trainer with real parts: the Megatron actor at tensor-parallel size 2 under Ray
(RayTrainGroup.trainer_log_probs) and engines behind a RolloutManager actor (RolloutManager.engine_log_probs): the
CPU engine server and real SGLang on CPU serving the trainer's weights agree with it to float noise, whatever the
rollout temperature the actor trains at, and a CPU engine serving other weights is far beyond the bound. A restart
reaches the engine on its address and it serves the checkpoint it was started from again."""

import argparse
import json

import pytest

from slime_search.health.config import HealthConfig
from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
from slime_search.run.engine_check import probe_gaps, probe_tokens
from slime_search.types import TrainSample
from slime_search.utils.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198]
RESPONSE = [40, 1079, 264, 10950, 17847, 13, 151645]  # a response, then the end of the turn
BOUND = HealthConfig().max_logprob_gap


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer(ray_session, tiny_checkpoint):
    """The tiny policy in Megatron at TP 2, training at rollout temperature 0.7 (the probe is at 1 all the same)."""
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.ray.train_group import ModelSource, RayTrainGroup, TrainGroupConfig

    group = RayTrainGroup(TrainGroupConfig(num_ranks=2, tp_size=2))
    group.load_models(
        ModelSource(str(tiny_checkpoint)), ActorConfig(loss=LossConfig(vocab_size=151936, temperature=0.7))
    )
    yield group
    group.shutdown()


def cpu_engine(checkpoint) -> ServerProcess:
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint), "--port", "0"]
    return ServerProcess([*argv, "--weight-version", "0"], health_path="/health_generate")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """(the trainer's weights, other weights): two CPU engine servers."""
    other = save_tiny_checkpoint(tmp_path_factory.mktemp("other"), TinyQwenConfig(seed=1))
    with cpu_engine(tiny_checkpoint) as right, cpu_engine(other) as wrong:
        yield right.url, wrong.url


def rollout_manager(urls: list[str] | None, checkpoint, folder):
    """A RolloutManager actor, as the driver starts it, over engines given by address (None: one CPU engine server it
    starts itself)."""
    import ray

    from slime_search.engines.deployment import EngineConfig
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import RolloutManager, RolloutManagerConfig
    from slime_search.rollout.rollout import RolloutConfig

    data = folder / "train.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "who?"}], "reward_model": {}}) + "\n")
    config = RolloutManagerConfig(
        engines=EngineConfig(str(checkpoint), engine_url=",".join(urls) if urls else None),
        data=DataConfig(str(data)),
        rollout=RolloutConfig(batch_size=1),
        generate_path="slime_search.search_r1.generate.generate",
        reward_path="slime_search.search_r1.reward.reward_func",
        log_dir=str(folder),
    )
    return ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=4).remote(config, argparse.Namespace())


def the_probe(ray, trainer, manager) -> tuple[dict[str, float], list[float]]:
    tokens = probe_tokens([TrainSample(PROMPT + RESPONSE, len(RESPONSE), [1] * len(RESPONSE))])
    trainer_side = trainer.trainer_log_probs(tokens)
    return probe_gaps(ray.get(manager.engine_log_probs.remote(tokens)), trainer_side), trainer_side


def hf_log_probs(checkpoint, tokens: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    return [log_probs[i - 1, token].item() for i, token in enumerate(tokens) if i]


def test_the_cpu_engine_agrees_with_the_trainer_and_one_serving_other_weights_does_not(
    ray_session, trainer, engines, tiny_checkpoint, tmp_path
):
    right, wrong = engines
    manager = rollout_manager([right, wrong], tiny_checkpoint, tmp_path)
    try:
        gaps, trainer_side = the_probe(ray_session, trainer, manager)
    finally:
        ray_session.kill(manager)
    # the trainer's half is the model's own distribution (temperature 1), not the rollout temperature's
    expected = hf_log_probs(tiny_checkpoint, PROMPT + RESPONSE)
    assert max(abs(a - b) for a, b in zip(trainer_side, expected, strict=True)) < 1e-4
    assert gaps[right] < 1e-4 < BOUND < gaps[wrong]


@pytest.mark.session_engine
def test_real_sglang_agrees_with_the_trainer_on_the_probe(ray_session, trainer, sglang_engine, tmp_path):
    from tests.conftest import reset_engine

    reset_engine(sglang_engine.url, sglang_engine.checkpoint)
    manager = rollout_manager([sglang_engine.url], sglang_engine.checkpoint, tmp_path)
    try:
        gaps, _ = the_probe(ray_session, trainer, manager)
    finally:
        ray_session.kill(manager)
    assert gaps[sglang_engine.url] < 1e-4


def test_a_restarted_engine_serves_its_starting_checkpoint_until_it_is_pushed(ray_session, tiny_checkpoint, tmp_path):
    """RolloutManager.restart_engine goes the way of a dead engine's restart: the engine comes back on its address
    with the checkpoint it was started from (version 0), which the recovery then pushes the current weights to; an
    engine the run did not start cannot be restarted (ValueError: the recovery stops the run instead)."""
    import asyncio

    from slime_search.engines.client import call_engine
    from slime_search.ray.placement import stop_rollout_manager

    ray = ray_session
    manager = rollout_manager(None, tiny_checkpoint, tmp_path)  # it starts a CPU engine server of its own
    try:
        [url] = ray.get(manager.worker_urls.remote())
        other = save_tiny_checkpoint(tmp_path / "other", TinyQwenConfig(seed=1))
        asyncio.run(call_engine(url, "update_weights_from_disk", str(other), "5"))
        ray.get(manager.restart_engine.remote(url))
        assert ray.get(manager.wait_restarted_engines.remote()) == [url]
        assert asyncio.run(call_engine(url, "weight_version")) == "0"
    finally:
        stop_rollout_manager(manager)
    given = rollout_manager(["http://127.0.0.1:9"], tiny_checkpoint, tmp_path)
    try:
        with pytest.raises(ValueError, match="is not an engine this run started"):
            ray.get(given.restart_engine.remote("http://127.0.0.1:9"))
    finally:
        ray.kill(given)
