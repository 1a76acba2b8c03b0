"""Activation recomputation (--recompute-granularity) changes memory, never the step: same losses and gradients."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port
from tests.backends.test_megatron_train import fixed_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETTINGS = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}


def _worker(rank, world, port, checkpoint, out_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape = ModelShape.from_hf_config(hf.config)
    config = ActorConfig(
        loss=LossConfig(vocab_size=shape.vocab_size), optim=OptimConfig(lr=1e-4), max_tokens_per_micro_batch=24
    )
    out = {}
    for name, recompute in SETTINGS.items():
        options = ModelOptions.from_hf_config(hf.config, **recompute)
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        out[name] = {"recomputes": model.config.recompute_granularity}
        actor = MegatronActor(model, config)
        samples = fixed_batch()
        for sample, lp in zip(samples, actor.compute_log_probs(samples), strict=True):
            sample.old_log_probs = lp
        out[name]["steps"] = [
            {k: v for k, v in actor.train_step(samples).items() if k in ("loss", "grad_norm")} for _ in range(3)
        ]
        out[name]["after"] = actor.compute_log_probs(samples)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(out, handle)
    shutdown()


def test_recomputed_activations_give_the_same_steps(tiny_checkpoint, tmp_path):
    out = tmp_path / "recompute.json"
    mp.spawn(_worker, args=(1, free_port(), str(tiny_checkpoint), str(out)), nprocs=1, join=True)
    results = json.loads(out.read_text())
    assert [results[name]["recomputes"] for name in SETTINGS] == [None, "full", "selective"]
    baseline = results["none"]
    for name in ("full", "selective"):
        for ours, theirs in zip(results[name]["steps"], baseline["steps"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
        for ours, theirs in zip(results[name]["after"], baseline["after"], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-5)
    # the steps moved the policy: the comparison is of trained weights, not of an untouched model
    assert baseline["steps"][0]["grad_norm"] > 0 and baseline["steps"][2]["loss"] != baseline["steps"][0]["loss"]
