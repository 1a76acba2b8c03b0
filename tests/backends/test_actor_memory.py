"""What an actor rank holds, from its built model: weights of every parameter, fp32 gradients and Adam's state of
those that train (and an fp32 master copy of low-precision ones), the state split by the distributed optimizer."""

import torch

from slime_search.backends.megatron.memory import actor_memory


def test_frozen_weights_hold_no_gradient_or_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20, bias=False), torch.nn.Linear(20, 5, bias=False))
    full = actor_memory(model)
    assert (full.parameters, full.trainable) == (300, 300)
    assert (full.weight_bytes, full.gradient_bytes, full.optimizer_bytes) == (1200, 1200, 2400)
    model[0].weight.requires_grad_(False)  # LoRA's frozen base
    frozen = actor_memory(model)
    assert (frozen.trainable, frozen.weight_bytes, frozen.gradient_bytes, frozen.optimizer_bytes) == (
        100,
        1200,
        400,
        800,
    )
    assert "100 of 300 parameters train" in frozen.describe()


def test_bf16_weights_add_an_fp32_master_copy_and_the_distributed_optimizer_splits_the_state():
    model = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    held = actor_memory(model, optimizer_shards=2)
    assert (held.weight_bytes, held.gradient_bytes, held.optimizer_bytes) == (128, 256, (2 * 64 + 64) * 4 // 2)
