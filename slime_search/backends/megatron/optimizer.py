"""Optimizer for the Megatron actor: Megatron's (optionally distributed) optimizer on GPU, plain Adam on CPU.

Megatron's optimizer wrappers allocate CUDA tensors, so on CPU a torch Adam steps the parameters, reading the
gradients Megatron DDP accumulated in `param.main_grad`; clipping uses the global gradient norm with every
tensor-parallel shard counted once and replicated parameters not double-counted. Both follow Megatron's parameter
groups: biases and other one-dimensional parameters (the norms) get no weight decay (`wd_mult` 0).
"""

from __future__ import annotations

import math

import torch

from slime_search.config.optim import OptimConfig


def learning_rate(step: int, config: OptimConfig) -> float:
    """Linear warm-up to lr, then constant, linear or cosine decay to min_lr over lr_decay_iters."""
    if config.lr_warmup_iters and step < config.lr_warmup_iters:
        return config.lr * (step + 1) / config.lr_warmup_iters
    if config.lr_decay_style == "constant" or not config.lr_decay_iters:
        return config.lr
    progress = min(1.0, (step - config.lr_warmup_iters) / max(1, config.lr_decay_iters - config.lr_warmup_iters))
    if config.lr_decay_style == "linear":
        factor = 1.0 - progress
    elif config.lr_decay_style == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown --lr-decay-style {config.lr_decay_style!r}; valid: constant, linear, cosine")
    return config.min_lr + (config.lr - config.min_lr) * factor


def decays(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule (optimizer/__init__.py, get_standard_config_overrides): biases and one-dimensional parameters
    (norm weights) get no weight decay."""
    return not (param.dim() == 1 or name.endswith(".bias"))


def apply_schedule(param_groups: list[dict], lr: float, weight_decay: float) -> None:
    """This step's learning rate and weight decay into every group, the decay scaled by the group's `wd_mult` as
    Megatron's own scheduler does (the optimizers are built with one decay for every group)."""
    for group in param_groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def refuse_update(norm: float, skip_above: float | None) -> bool:
    """Whether a step with this gradient norm must not be applied: not finite (a NaN or inf anywhere in the
    gradients), or above the bound the health guard sets for a spike."""
    return not math.isfinite(norm) or (skip_above is not None and norm > skip_above)


class CpuAdam:
    def __init__(self, model, config: OptimConfig):
        self.config = config
        self.lr_scale = 1.0  # the health guard's remedy after a rollback (lr halved), set by the driver
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = [
            {"params": [p for name, p in named if decays(name, p) == decayed], "wd_mult": 1.0 if decayed else 0.0}
            for decayed in (True, False)
        ]
        self.adam = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.iteration = 0

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros(())
        for p in self.params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.float().square().sum()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        return float(squares.sqrt())

    def current_lr(self) -> float:
        return learning_rate(self.iteration, self.config) * self.lr_scale

    def step(self, skip_above: float | None = None) -> tuple[bool, float]:
        """Adam step on the DDP-reduced gradients; returns (applied, grad norm before clipping). Not applied (and the
        iteration not counted) when `refuse_update` says so."""
        for p in self.params:
            p.grad = getattr(p, "main_grad", p.grad)
        norm = self.grad_norm()
        if refuse_update(norm, skip_above):
            return False, norm
        if self.config.clip_grad and norm > self.config.clip_grad:
            scale = self.config.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        apply_schedule(self.adam.param_groups, self.current_lr(), self.config.weight_decay)
        self.adam.step()
        self.iteration += 1
        return True, norm

    def state_dict(self) -> dict:
        return {"adam": self.adam.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        adam = state["adam"]
        if len(adam["param_groups"]) == 1 < len(self.adam.param_groups):
            adam = self._regrouped(adam)
        self.adam.load_state_dict(adam)
        self.iteration = state["iteration"]

    def _regrouped(self, adam: dict) -> dict:
        """A state saved with every parameter in one group (checkpoints written before weight decay followed
        Megatron's groups): its per-parameter state renumbered into today's groups, whose other settings stay."""
        position = {id(p): k for k, p in enumerate(p for group in self.adam.param_groups for p in group["params"])}
        renumber = {old: position[id(p)] for old, p in enumerate(self.params)}
        groups = self.adam.state_dict()["param_groups"]
        return {"state": {renumber[k]: v for k, v in adam["state"].items()}, "param_groups": groups}


def megatron_optimizer_config(config: OptimConfig, params_dtype: torch.dtype):
    """Megatron's OptimizerConfig for a model with `params_dtype` parameters. bf16 (or fp16) must say so: Megatron then
    builds its mixed-precision optimizer, which keeps fp32 main weights and steps them; told fp32, it builds
    FP32Optimizer, which fails on bf16 parameters and would otherwise step them directly, rounding updates of
    lr 1e-6 away."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        main_params_dtype=torch.float32,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )


class GpuOptimizer:
    """Megatron's optimizer (distributed when configured) with the same step() contract as CpuAdam."""

    def __init__(self, ddp_model, config: OptimConfig, params_dtype: torch.dtype):
        from megatron.core.optimizer import get_megatron_optimizer

        self.config = config
        self.optimizer = get_megatron_optimizer(megatron_optimizer_config(config, params_dtype), [ddp_model])
        self.iteration = 0
        self.lr_scale = 1.0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def current_lr(self) -> float:
        return learning_rate(self.iteration, self.config) * self.lr_scale

    def step(self, skip_above: float | None = None) -> tuple[bool, float]:
        """Megatron's optimizer step taken apart, as its own `step` is, so that the gradient norm is known before the
        update. With bf16 and no loss scaler Megatron checks no NaN and would apply one. And a spike must be refused
        before it is applied."""
        if self.optimizer.prepare_grads():  # fp16 loss scaling found an inf
            return False, math.inf
        norm = float(self.optimizer.get_grad_norm())
        if refuse_update(norm, skip_above):
            return False, norm
        self._clip(norm)
        apply_schedule(self.optimizer.param_groups, self.current_lr(), self.config.weight_decay)
        applied = self.optimizer.step_with_ready_grads()
        self.iteration += 1
        return bool(applied), norm

    def _clip(self, norm: float) -> None:
        """Scale the gradients to at most clip_grad by the norm already computed (as Megatron's chained step does)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = optimizer.get_parameters()
            if params and optimizer.config.clip_grad > 0.0:
                decoupled = optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                clip_grad_by_total_norm_fp32(params, optimizer.config.clip_grad, norm, decoupled)

    def state_dict(self) -> dict:
        """Adam moments, fp32 main weights (bf16 training) and the step count, for this rank (see save_actor).
        The distributed optimizer keeps its per-parameter state outside state_dict, so it is refused here rather
        than saved without its moments."""
        if self.config.use_distributed_optimizer:
            raise NotImplementedError("checkpointing the distributed optimizer's sharded state is not supported")
        return {"megatron": self.optimizer.state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        if self.config.use_distributed_optimizer:
            raise NotImplementedError("checkpointing the distributed optimizer's sharded state is not supported")
        self.optimizer.load_state_dict(state["megatron"])
        self.iteration = state["iteration"]


def build_optimizer(ddp_model, config: OptimConfig, params_dtype: torch.dtype):
    from slime_search.backends.megatron import cpu_compat

    if cpu_compat.is_active():
        if params_dtype != torch.float32:  # CpuAdam keeps no fp32 master copy: small updates would round away
            raise ValueError(
                f"{params_dtype} parameters train on GPU only (Megatron's mixed precision); use fp32 on CPU"
            )
        return CpuAdam(ddp_model, config)
    return GpuOptimizer(ddp_model, config, params_dtype)
