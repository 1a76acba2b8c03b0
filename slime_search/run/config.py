"""The typed configuration of every component, built once from the parsed flags (`run_config`): the driver hands
these to the components, which never read the flags themselves. (The plugins still receive the flags as `args`,
slime's plugin contract.) Each flag is a field of one config class (`slime_search.config`, utils.flag_fields);
`typed_flags` builds every class the flags alone determine, and building one checks it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slime_search.config.checkpoints import CheckpointConfig
from slime_search.config.cluster import ClusterConfig
from slime_search.config.logs import LogConfig
from slime_search.config.lora import LoraConfig
from slime_search.config.rollout import DataConfig, RolloutConfig, RolloutManagerConfig, SamplingConfig
from slime_search.config.training import ImportanceWeightsConfig, TrainingConfig
from slime_search.evaluation.flags import EvalConfig
from slime_search.evaluation.subsets import EvalSubset
from slime_search.health.config import HealthConfig, health_config
from slime_search.rollout.schedule import ScheduleConfig
from slime_search.utils.flag_fields import from_flags
from slime_search.weight_sync.transports import default_transport

if TYPE_CHECKING:
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.ray.train_group import ModelSource, TrainGroupConfig
    from slime_search.weight_sync.transport_base import WeightSyncConfig


@dataclass(frozen=True)
class TypedFlags:
    """The parsed flags as the config classes they declare, each built once (its construction checks it). The loss,
    the optimizer and the engines take fields from the run as well: `actor_config` and `engine_config` build them."""

    checkpoints: CheckpointConfig
    cluster: ClusterConfig
    data: DataConfig
    rollout: RolloutConfig
    sampling: SamplingConfig
    training: TrainingConfig
    importance: ImportanceWeightsConfig
    evaluation: EvalConfig
    eval_subset: EvalSubset
    logs: LogConfig
    schedule: ScheduleConfig
    health: HealthConfig


def typed_flags(args: argparse.Namespace) -> TypedFlags:
    training = from_flags(TrainingConfig, args)
    return TypedFlags(
        checkpoints=from_flags(CheckpointConfig, args),
        cluster=from_flags(ClusterConfig, args),
        data=from_flags(DataConfig, args),
        rollout=from_flags(RolloutConfig, args, normalize_advantages_std=training.advantage_estimator == "grpo"),
        sampling=from_flags(SamplingConfig, args),
        training=training,
        importance=from_flags(ImportanceWeightsConfig, args),
        evaluation=from_flags(EvalConfig, args),
        eval_subset=from_flags(EvalSubset, args),
        logs=from_flags(LogConfig, args),
        schedule=from_flags(ScheduleConfig, args),
        health=health_config(args),
    )


def steps_per_rollout(args: argparse.Namespace) -> int:
    """Optimizer steps per rollout: the rollout's samples over --global-batch-size (one without it)."""
    if args.global_batch_size is None:
        return 1
    return args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size


def weight_transport(args: argparse.Namespace) -> str:
    """--update-weight-transport, or the fastest transport the placement allows."""
    return args.update_weight_transport or default_transport(args.colocate, bool(args.rollout_num_gpus))


def eval_sets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data NAME PATH [NAME PATH ...] as (name, path) pairs (also for the eval CLI's flags)."""
    return EvalConfig(prompt_data=tuple(args.eval_prompt_data)).sets


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
    lora = from_flags(LoraConfig, args)
    if lora.enabled and args.attention_impl == "auto":
        overrides["attention_impl"] = "packed"  # the adapters wrap Megatron's local linears, not TransformerEngine's
    # Given with ${MODEL_ARGS[@]}, they shape the model as they shaped a converted torch_dist checkpoint (the vocab
    # padding is the embedding's size); left out, config.json's context length and Megatron's padding of 128 apply.
    for name in ("make_vocab_size_divisible_by", "max_position_embeddings"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return ModelSource(args.hf_checkpoint, args.load, args.use_kl_loss, args.ref_load, overrides, lora)


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

    training = from_flags(TrainingConfig, args)
    use_tis, mis = from_flags(ImportanceWeightsConfig, args).resolve(args.use_tis, args.tis_cap)
    return ActorConfig(
        loss=from_flags(
            LossConfig,
            args,
            kl_coef=args.kl_loss_coef if training.use_kl_loss else 0.0,
            reduction=training.reduction,
            use_tis=use_tis,
            mis=mis,
            custom_tis=custom_tis(args),
            temperature=args.rollout_temperature,
            vocab_size=vocab_size,
        ),
        optim=from_flags(OptimConfig, args, lr_decay_iters=lr_decay_iters(args)),
        max_tokens_per_micro_batch=training.max_tokens_per_gpu,
        probe_tokens=args.health_probe_tokens,
    )


def engine_config(args: argparse.Namespace, use_gpu: bool, colocated_gpus: int = 0, lora_args: tuple[str, ...] = ()):
    """`colocated_gpus`: the actor's GPUs, which colocated engines take (one engine GPU per actor GPU); `lora_args`:
    SGLang's LoRA serving flags (sglang_lora_args)."""
    from slime_search.config.engines import EngineConfig

    colocated = bool(colocated_gpus) and use_gpu
    return from_flags(
        EngineConfig,
        args,
        model_path=args.hf_checkpoint,
        num_gpus=colocated_gpus if colocated else args.rollout_num_gpus,
        memory_saver=colocated,
        seed=args.seed,
        lora_args=lora_args,
    )


def sglang_lora_args(lora: LoraConfig) -> tuple[str, ...]:
    """What SGLang engines need to serve the adapters alone (--lora-sync-from-tensor): LoRA on, up to the adapters'
    rank, on their projections, one adapter at a time (each push replaces it)."""
    if lora.served_adapter is None:
        return ()
    return (
        "--enable-lora", "--max-lora-rank", str(lora.lora_rank), "--lora-target-modules", *lora.hf_target_modules,
        "--max-loras-per-batch", "1",
    )  # fmt: skip


def sampling_params(args: argparse.Namespace, greedy: bool = False) -> dict[str, Any]:
    """What the engines sample with: a training rollout's (seeded by --rollout-seed) or an evaluation's (greedy)."""
    if greedy:  # the eval CLI declares only --rollout-max-response-len of the sampling flags
        return SamplingConfig(max_new_tokens=args.rollout_max_response_len).greedy_params()
    return from_flags(SamplingConfig, args).params(args.rollout_seed)


def rollout_manager_config(args: argparse.Namespace, engines) -> RolloutManagerConfig:
    flags = typed_flags(args)
    lora = from_flags(LoraConfig, args)
    return from_flags(
        RolloutManagerConfig,
        args,
        engines=engines,
        data=flags.data,
        rollout=flags.rollout,
        sampling_params=flags.sampling.params(flags.data.seed),
        eval_sampling_params=flags.sampling.greedy_params(),
        eval_sets=flags.evaluation.sets,
        eval_subset=flags.eval_subset,
        log_dir=args.save,
        served_adapter=lora.served_adapter,
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
    train_group: TrainGroupConfig
    model: ModelSource
    actor: ActorConfig
    rollout: RolloutManagerConfig
    weight_sync: WeightSyncConfig
    schedule: ScheduleConfig  # when rollouts run relative to training
    wandb: tuple[bool, str, str | None]  # MetricsSink's use_wandb, project, group
    health: HealthConfig = field(default_factory=HealthConfig)  # the health guard's rules and bounds
    eval_engine: RolloutManagerConfig | None = None  # the engine that evaluates beside training (--eval-engine)
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
    from slime_search.weight_sync.transport_base import WeightSyncConfig

    flags = typed_flags(args)
    checkpoints, cluster = flags.checkpoints, flags.cluster
    lora = from_flags(LoraConfig, args)
    colocated_gpus = cluster.actor_gpus if cluster.colocate else 0
    engines = engine_config(args, use_gpu, colocated_gpus, lora_args=sglang_lora_args(lora))
    return RunConfig(
        run_dir=checkpoints.save,
        num_rollout=flags.training.num_rollout,
        save_interval=checkpoints.save_interval,
        keep_checkpoints=checkpoints.keep_checkpoints,
        save_hf=checkpoints.save_hf,
        eval_interval=flags.evaluation.interval,
        log_rollout_examples=flags.logs.log_rollout_examples,
        colocate=cluster.colocate,
        serves_policy=args.loss_type != "sft",
        steps_per_rollout=steps_per_rollout(args),
        train_group=TrainGroupConfig(
            cluster.actor_gpus,
            cluster.tensor_model_parallel_size,
            use_gpu=use_gpu,
            seed=checkpoints.seed,
            log_dir=checkpoints.save,
        ),
        model=model_source(args),
        actor=actor_config(args, vocab_size),
        rollout=rollout_manager_config(args, engines),
        weight_sync=WeightSyncConfig(
            transport=weight_transport(args),
            bucket_bytes=cluster.update_weight_buffer_size,
            hf_checkpoint=checkpoints.hf_checkpoint,
            disk_dir=str(Path(checkpoints.save) / "weights"),
            ranks_per_engine=engines.ranks_per_engine,
            served_adapter=lora.served_adapter,
            lora_rank=lora.lora_rank,
            push_base_first=lora.served_adapter is not None and checkpoints.load is not None,
        ),
        schedule=flags.schedule,
        wandb=(flags.logs.use_wandb, flags.logs.wandb_project, flags.logs.wandb_group),
        health=flags.health,
        eval_engine=eval_engine_config(args, engines) if flags.evaluation.engine else None,
        eval_timeout=flags.evaluation.timeout,
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
