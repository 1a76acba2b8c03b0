"""Weight decay follows Megatron's parameter groups: biases and norms get none, on the CPU optimizer and on the
groups Megatron's own optimizer is built with (the learning rate and the decay are set by the project each step)."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _worker(rank, world, port, checkpoint, out_path):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from transformers import AutoConfig

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model
    from slime_search.backends.megatron.optimizer import CpuAdam, OptimConfig, apply_schedule

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    model = build_gpt_model(ModelShape.from_hf_config(hf_config), ModelOptions.from_hf_config(hf_config))
    ddp = DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    names = {id(p): name for name, p in ddp.named_parameters()}
    # Megatron's groups, as get_megatron_optimizer hands them to torch's AdamW with one weight decay for all
    megatron_groups = _get_param_groups([ddp], OptimizerConfig(lr=0.1, weight_decay=0.5), None)
    megatron_adam = torch.optim.AdamW(megatron_groups, lr=0.1, weight_decay=0.5)
    apply_schedule(megatron_adam.param_groups, lr=0.1, weight_decay=0.5)
    megatron_decay = {names[id(p)]: g["weight_decay"] for g in megatron_adam.param_groups for p in g["params"]}
    # the CPU optimizer: one step with zero gradients moves a parameter by its weight decay alone
    with torch.no_grad():  # the biases start at zero: give them something to decay
        for name, p in ddp.named_parameters():
            if name.endswith(".bias"):
                p.fill_(1.0)
    before = {name: p.detach().double().clone() for name, p in ddp.named_parameters()}
    ddp.zero_grad_buffer()
    optimizer = CpuAdam(ddp, OptimConfig(lr=0.1, weight_decay=0.5, clip_grad=0.0))
    applied, _ = optimizer.step()
    shrink = {
        name: float((p.detach().double().norm() / before[name].norm()).item()) for name, p in ddp.named_parameters()
    }
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"megatron": megatron_decay, "shrink": shrink, "applied": applied}, handle)
    shutdown()


def test_biases_and_norms_get_no_weight_decay(tiny_checkpoint, tmp_path):
    out = tmp_path / "decay.json"
    mp.spawn(_worker, args=(1, free_port(), str(tiny_checkpoint), str(out)), nprocs=1, join=True)
    result = json.loads(out.read_text())
    exempt = {name for name in result["megatron"] if name.endswith(".bias") or "norm" in name}
    assert exempt and any(name.endswith("linear_qkv.bias") for name in exempt)  # Qwen2's q/k/v biases
    assert {name for name, decay in result["megatron"].items() if decay == 0.0} == exempt
    assert all(decay == 0.5 for name, decay in result["megatron"].items() if name not in exempt)
    assert result["applied"]
    for name, ratio in result["shrink"].items():  # AdamW's decoupled decay: p <- p (1 - lr x wd) = 0.95 p
        assert ratio == pytest.approx(1.0 if name in exempt else 0.95, abs=1e-6), name


@pytest.mark.timeout(60)
def test_a_cpu_optimizer_state_saved_in_one_group_loads_into_the_decay_groups():
    """Checkpoints written before the CPU optimizer split its parameters by weight decay hold one group: each
    parameter's moments still reach that parameter."""
    from slime_search.backends.megatron.optimizer import CpuAdam, OptimConfig

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    params = [p for p in model.parameters()]
    one_group = torch.optim.AdamW(params, lr=0.1)
    for k, p in enumerate(params):  # moments that name their parameter
        one_group.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.full_like(p, k), "exp_avg_sq": p * 0 + k}
    optimizer = CpuAdam(model, OptimConfig(lr=0.1, weight_decay=0.5))
    assert len(optimizer.adam.param_groups) == 2
    optimizer.load_state_dict({"adam": one_group.state_dict(), "iteration": 3})
    for k, p in enumerate(params):
        assert torch.equal(optimizer.adam.state[p]["exp_avg"], torch.full_like(p, k))
    assert [g["wd_mult"] for g in optimizer.adam.param_groups] == [1.0, 0.0] and optimizer.iteration == 3
