"""The typed configuration of every component, built once from the parsed flags (`run_config`): the driver hands
these to the components, which never read the flags themselves. (The plugins still receive the flags as `args`,
slime's plugin contract.)"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from typing import Any

from slime_search.arguments import eval_sets, steps_per_rollout, weight_transport
from slime_search.evaluation.subsets import eval_subset
from slime_search.health.config import HealthConfig, health_config
from slime_search.utils.flag_fields import from_flags


def model_source(args: argparse.Namespace):
    """The actor's architecture and weights, and options the flags set beyond what config.json holds."""
    import torch

    from slime_search.ray.train_group import ModelSource

    overrides = {
        "sequence_parallel": args.sequence_parallel,
        "params_dtype": torch.bfloat16 if args.bf16 else torch.float32,
        "recompute_granularity": args.recompute_granularity,
        "recompute_method": args.recompute_method,
        "recompute_num_layers": args.recompute_num_layers,
        "attention_impl": args.attention_impl,
    }
    # Given with ${MODEL_ARGS[@]}, they shape the model as they shaped a converted torch_dist checkpoint (the vocab
    # padding is the embedding's size); left out, config.json's context length and Megatron's padding of 128 apply.
    for name in ("make_vocab_size_divisible_by", "max_position_embeddings"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return ModelSource(args.hf_checkpoint, args.load, args.use_kl_loss, args.ref_load, overrides)


def importance_weights(args: argparse.Namespace):
    """LossConfig's (use_tis, mis): vanilla TIS, the general form (--use-mis), or neither (also when a custom TIS
    function takes vanilla TIS's place: `custom_tis`)."""
    from slime_search.algo.importance import ISConfig

    if args.custom_tis_function_path is not None:
        return False, None
    if args.use_mis:
        return False, ISConfig(
            level=args.mis_level,
            mode=args.mis_mode,
            upper=args.mis_upper,
            lower=args.mis_lower,
            veto_threshold=args.mis_veto_threshold,
            batch_normalize=args.mis_batch_normalize,
        )
    if args.use_tis and args.tis_clip_low > 0:
        # slime's clamp(w, --tis-clip-low, --tis-clip) per token is the general form at token level in clip mode
        return False, ISConfig(level="token", mode="clip", upper=args.tis_cap, lower=args.tis_clip_low)
    return args.use_tis, None


def custom_tis(args: argparse.Namespace):
    """--custom-tis-function-path with the flags it reads (slime passes its TIS function `args`), or None."""
    from slime_search.backends.megatron.custom_tis import CustomTIS

    return CustomTIS(args.custom_tis_function_path, args) if args.custom_tis_function_path is not None else None


def lr_decay_iters(args: argparse.Namespace) -> int | None:
    """--lr-decay-iters, else (with a decay style) the whole run in optimizer steps, as Megatron defaults it."""
    if args.lr_decay_iters is None and args.lr_decay_style != "constant":
        return args.num_rollout * steps_per_rollout(args)
    return args.lr_decay_iters


def actor_config(args: argparse.Namespace, vocab_size: int):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.config.loss import LossConfig
    from slime_search.config.optim import OptimConfig

    use_tis, mis = importance_weights(args)
    return ActorConfig(
        loss=from_flags(
            LossConfig,
            args,
            kl_coef=args.kl_loss_coef if args.use_kl_loss else 0.0,
            reduction="token_mean" if args.calculate_per_token_loss else "sequence_mean",
            use_tis=use_tis,
            mis=mis,
            custom_tis=custom_tis(args),
            temperature=args.rollout_temperature,
            vocab_size=vocab_size,
        ),
        optim=from_flags(OptimConfig, args, lr_decay_iters=lr_decay_iters(args)),
        max_tokens_per_micro_batch=args.max_tokens_per_gpu,
        probe_tokens=args.health_probe_tokens,
    )


def engine_config(args: argparse.Namespace, use_gpu: bool, colocated_gpus: int = 0):
    """`colocated_gpus`: the actor's GPUs, which colocated engines take (one engine GPU per actor GPU)."""
    from slime_search.config.engines import EngineConfig

    colocated = bool(colocated_gpus) and use_gpu
    return from_flags(
        EngineConfig,
        args,
        model_path=args.hf_checkpoint,
        num_gpus=colocated_gpus if colocated else args.rollout_num_gpus,
        memory_saver=colocated,
        cpu_engine_args=tuple(shlex.split(args.cpu_engine_args)),
        seed=args.seed,
    )


def sampling_params(args: argparse.Namespace, greedy: bool = False) -> dict[str, Any]:
    """What the engines sample with; a training rollout's `sampling_seed` is the base of each trajectory's own."""
    if greedy:
        return {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": args.rollout_max_response_len}
    return {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "max_new_tokens": args.rollout_max_response_len,
        "sampling_seed": args.rollout_seed,
    }


def rollout_manager_config(args: argparse.Namespace, engines):
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import RolloutManagerConfig
    from slime_search.rollout.rollout import RolloutConfig

    return RolloutManagerConfig(
        engines=engines,
        data=DataConfig(
            args.prompt_data, args.input_key, args.label_key, shuffle=args.rollout_shuffle, seed=args.rollout_seed
        ),
        rollout=RolloutConfig(
            batch_size=args.rollout_batch_size,
            n_samples_per_prompt=args.n_samples_per_prompt,
            filter_zero_std=args.over_sampling_filter_zero_std,
            max_concurrency=args.rollout_concurrency,
            reward_key=args.reward_key,
            normalize_advantages_std=args.advantage_estimator == "grpo",
        ),
        generate_path=args.custom_generate_function_path,
        reward_path=args.custom_rm_path,
        sampling_params=sampling_params(args),
        eval_sampling_params=sampling_params(args, greedy=True),
        eval_sets=eval_sets(args),
        eval_subset=eval_subset(args),
        log_dir=args.save,
    )


@dataclass(frozen=True)
class RunConfig:
    """Everything the driver hands to the components, built once from the flags."""

    run_dir: str
    num_rollout: int
    save_interval: int  # 0: only at the end
    keep_checkpoints: int  # 0: every checkpoint
    save_hf: bool  # an HF folder beside each checkpoint (RUN/hf/step_N), pruned with it
    eval_interval: int  # 0: only at the end (when there are eval sets)
    log_rollout_examples: int
    colocate: bool
    serves_policy: bool  # whether the engines generate with the policy being trained (not in SFT)
    steps_per_rollout: int
    train_group: Any  # TrainGroupConfig
    model: Any  # ModelSource
    actor: Any  # ActorConfig
    rollout: Any  # RolloutManagerConfig
    weight_sync: Any  # WeightSyncConfig
    schedule: Any  # ScheduleConfig: when rollouts run relative to training
    wandb: tuple[bool, str, str | None]  # MetricsSink's use_wandb, project, group
    health: HealthConfig = field(default_factory=HealthConfig)  # the health guard's rules and bounds
    eval_engine: Any = None  # RolloutManagerConfig of the engine that evaluates beside training (--eval-engine)
    # seconds one evaluation may take (--eval-timeout; None: evaluation.flags scales it with the questions)
    eval_timeout: float | None = None

    def eval_due(self, version: int) -> bool:
        if not self.rollout.eval_sets or not self.serves_policy:
            return False
        return version == self.num_rollout or bool(self.eval_interval and version % self.eval_interval == 0)

    def save_due(self, steps_done: int) -> bool:
        """Every --save-interval steps and at the end; with the guard on, every evaluated version too: the guard can
        roll back to, stop on or end on an evaluated version only when it has a checkpoint."""
        if steps_done == self.num_rollout or bool(self.save_interval and steps_done % self.save_interval == 0):
            return True
        return self.health.enabled and bool(self.save_interval) and self.eval_due(steps_done)


def run_config(args: argparse.Namespace, vocab_size: int, use_gpu: bool) -> RunConfig:
    from pathlib import Path

    from slime_search.ray.train_group import TrainGroupConfig
    from slime_search.rollout.schedule import ScheduleConfig
    from slime_search.weight_sync.transport_base import WeightSyncConfig

    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    engines = engine_config(args, use_gpu, colocated_gpus=actor_gpus if args.colocate else 0)
    return RunConfig(
        run_dir=args.save,
        num_rollout=args.num_rollout,
        save_interval=args.save_interval,
        keep_checkpoints=args.keep_checkpoints,
        save_hf=args.save_hf,
        eval_interval=args.eval_interval,
        log_rollout_examples=args.log_rollout_examples,
        colocate=args.colocate,
        serves_policy=args.loss_type != "sft",
        steps_per_rollout=steps_per_rollout(args),
        train_group=TrainGroupConfig(
            actor_gpus, args.tensor_model_parallel_size, use_gpu=use_gpu, seed=args.seed, log_dir=args.save
        ),
        model=model_source(args),
        actor=actor_config(args, vocab_size),
        rollout=rollout_manager_config(args, engines),
        weight_sync=WeightSyncConfig(
            transport=weight_transport(args),
            bucket_bytes=args.update_weight_buffer_size,
            hf_checkpoint=args.hf_checkpoint,
            disk_dir=str(Path(args.save) / "weights"),
            ranks_per_engine=engines.ranks_per_engine,
        ),
        schedule=from_flags(ScheduleConfig, args),
        wandb=(args.use_wandb, args.wandb_project, args.wandb_group),
        health=health_config(args),
        eval_engine=eval_engine_config(args, engines) if args.eval_engine else None,
        eval_timeout=args.eval_timeout,
    )


def eval_engine_config(args: argparse.Namespace, engines):
    """The rollout side of --eval-engine: the run's plugins, eval sets and greedy sampling on one engine of its own
    (one CPU engine server; on GPU one SGLang engine of --rollout-num-gpus-per-engine GPUs; or --eval-engine-url),
    its logs in RUN/eval_engine."""
    from dataclasses import replace
    from pathlib import Path

    one = replace(
        engines,
        engine_url=args.eval_engine_url,
        num_gpus=engines.gpus_per_engine if engines.num_gpus else 0,
        memory_saver=False,
        cpu_engines=1,
        cpu_engine_args=(),  # faults injected into the rollout engines are not the evaluator's
    )
    return replace(rollout_manager_config(args, one), log_dir=str(Path(args.save) / "eval_engine"))
