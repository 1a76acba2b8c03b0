"""--colocate's memory hand-over on the actor side: offload frees every storage, onload restores it bit for bit."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.backends.megatron.offload import StorageOffloader
from slime_search.utils.net import free_port
from tests.backends.test_megatron_train import fixed_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_views_survive_the_round_trip_and_memory_is_really_released():
    base = torch.arange(12.0)
    head, tail = base[:4].view(2, 2), base[4:]
    other = torch.ones(3)
    offloader = StorageOffloader()
    assert offloader.offload([head, tail, other, base]) == 12 * 4 + 3 * 4  # each storage once
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="already offloaded"):
        offloader.offload([other])
    assert offloader.onload() == 60
    assert head.tolist() == [[0.0, 1.0], [2.0, 3.0]] and tail.tolist() == [float(i) for i in range(4, 12)]
    assert other.tolist() == [1.0, 1.0, 1.0] and not offloader.offloaded
    # the next round trip reuses the host buffers: no host memory is allocated per step
    assert offloader.allocated_bytes == 60
    base.add_(1.0)
    assert offloader.offload([head, tail, other, base]) == 60 and offloader.allocated_bytes == 60
    offloader.onload()
    assert base.tolist() == [float(i + 1) for i in range(12)] and other.tolist() == [1.0, 1.0, 1.0]


def _worker(rank, world, port, checkpoint, out_path, lora_rank=0):
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor, ReferenceModel
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.lora import LoraConfig, apply_lora
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
    config = ActorConfig(
        loss=LossConfig(eps_clip=0.2, eps_clip_high=0.28, vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-3, clip_grad=1.0),
        max_tokens_per_micro_batch=24,
    )

    def new_model(lora: int = 0):
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        apply_lora(model, LoraConfig(lora_rank=lora))  # nothing when 0
        return model

    plain, colocated = MegatronActor(new_model(lora_rank), config), MegatronActor(new_model(lora_rank), config)
    with torch.no_grad():  # the same start: each build draws its adapters' A at random
        for ours, theirs in zip(colocated.model.module.parameters(), plain.model.module.parameters(), strict=True):
            ours.copy_(theirs)
    samples = fixed_batch()
    for sample, lp in zip(samples, plain.compute_log_probs(samples), strict=True):
        sample.old_log_probs = lp
    plain_history = [plain.train_step(samples) for _ in range(3)]
    colocated_history, released, host_allocated, grads_zero = [], [], [], []
    grad_buffers = [buffer.grad_data for buffer in colocated.model.buffers]
    for _ in range(3):  # step, then hand the memory over and take it back, as between a rollout and a step
        colocated_history.append(colocated.train_step(samples))
        released.append(colocated.offload())
        emptied = all(p.untyped_storage().nbytes() == 0 for p in colocated.model.parameters())
        emptied = emptied and all(g.untyped_storage().nbytes() == 0 for g in grad_buffers)
        state = colocated.optimizer.adam.state
        emptied = emptied and all(s["exp_avg"].untyped_storage().nbytes() == 0 for s in state.values())
        released.append(emptied)
        colocated.onload()
        host_allocated.append(colocated.offloader.allocated_bytes)
        grads_zero.append(all(bool((g == 0).all()) for g in grad_buffers))  # not copied: they come back as zeros
    same = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), colocated.model.parameters(), strict=True))
    reference = ReferenceModel(new_model(), config)
    before = reference.compute_log_probs(samples)
    reference.offload()
    reference.onload()
    reference_same = reference.compute_log_probs(samples) == before  # a collective: every rank computes it
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(
                {
                    "plain": plain_history,
                    "colocated": colocated_history,
                    "released": released,
                    "same_weights": same,
                    "reference_same": reference_same,
                    "host_allocated": host_allocated,
                    "grads_zero": grads_zero,
                    "grad_bytes": sum(g.numel() * g.element_size() for g in grad_buffers),
                    "param_bytes": sum(p.numel() * p.element_size() for p in plain.model.parameters()),
                },
                handle,
            )
    shutdown()


@pytest.mark.parametrize(("tp", "lora_rank"), [(1, 0), (2, 0), (2, 4)])
def test_training_with_offload_between_steps_equals_training_without(tiny_checkpoint, tmp_path, tp, lora_rank):
    """Full fine-tuning, and LoRA at TP 2: under LoRA only what exists is handed over, the frozen weights and the
    adapters' own gradients and Adam state."""
    out = tmp_path / "offload.json"
    mp.spawn(_worker, args=(tp, free_port(), str(tiny_checkpoint), str(out), lora_rank), nprocs=tp, join=True)
    result = json.loads(out.read_text())
    assert result["colocated"] == result["plain"]  # every metric of every step, exactly
    assert result["same_weights"] and result["reference_same"]
    sizes, emptied = result["released"][0::2], result["released"][1::2]
    assert all(emptied)
    if lora_rank:  # the weights, and the adapters' gradient buffer and Adam moments: a sliver more than the weights
        assert result["param_bytes"] < min(sizes) <= max(sizes) < 1.05 * result["param_bytes"]
        assert 0 < result["grad_bytes"] < 0.02 * result["param_bytes"]
    else:  # weights + the DDP gradient buffer + Adam's two moments: 4x the (local) weights are handed over
        assert min(sizes) >= 4 * result["param_bytes"]
    # the gradient buffer is freed without a copy (each step zeroes it first) and comes back as zeros; host buffers
    # for the rest are allocated at the first hand-over only (the same storages every step)
    assert result["grads_zero"] == [True] * 3 and (lora_rank or result["grad_bytes"] >= result["param_bytes"])
    assert result["host_allocated"] == [sizes[0] - result["grad_bytes"]] * 3
