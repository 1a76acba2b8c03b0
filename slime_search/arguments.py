"""Command-line flags with slime's names, and their conversion into each component's typed config.

The driver parses once (`parse_args`, which only validates) and builds every config once (`run_config`); the parsed
flags are never changed afterwards. The plugins still receive the flags as `args` (slime's plugin contract), with
the engines' address added by the RolloutManager on a copy. Argument groups are shared with the eval CLI.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from slime_search.rollout.schedule import ASYNC_MODES
from slime_search.search_r1.config import add_search_r1_arguments
from slime_search.weight_sync.transports import TRANSPORTS, default_transport, transport_kind


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engines")
    g.add_argument("--rollout-num-gpus", type=int, default=0, help="GPUs for SGLang engines (0: the CPU engine)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    g.add_argument("--sglang-mem-fraction-static", type=float, default=0.8)
    g.add_argument("--sglang-router-port", type=int, default=0)
    g.add_argument(
        "--engine-url", default=None, help="use these running engines (URL[,URL...]) instead of starting any"
    )
    g.add_argument("--engine-max-batch-size", type=int, default=32, help="CPU engine: sequences decoded together")
    g.add_argument("--cpu-engines", type=int, default=1, help="CPU engine servers on a machine without GPUs")
    g.add_argument(
        "--engine-health-timeout",
        type=float,
        default=60.0,
        help="seconds an engine has to generate one token in the check after each rollout; one that fails it (or has "
        "exited) is started again and takes the next weight push",
    )


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """How prompt rows are read and which plugins turn them into scored samples."""
    g = parser.add_argument_group("prompts and plugins")
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--label-key", default="reward_model")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--rollout-max-response-len", type=int, default=512, help="max new tokens per turn")
    g.add_argument("--reward-key", default="score")
    g.add_argument("--custom-generate-function-path", default="slime_search.search_r1.generate.generate")
    g.add_argument("--custom-rm-path", default="slime_search.search_r1.reward.reward_func")


def build_parser() -> argparse.ArgumentParser:
    from slime_search.backends.megatron.model_args import add_model_arguments

    parser = argparse.ArgumentParser(description="slime-search: GRPO training of a search-calling LLM")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--hf-checkpoint", required=True, help="HF folder: architecture, tokenizer, initial weights")
    g.add_argument("--load", default=None, help="torch_dist folder with the initial actor weights (else the HF ones)")
    g.add_argument("--ref-load", default=None, help="torch_dist folder of the KL reference (else the initial weights)")
    g.add_argument("--save", required=True, help="run folder: checkpoints, synced weights, metrics, report")
    g.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument(
        "--keep-checkpoints", type=int, default=2, help="newest checkpoints kept in SAVE/checkpoints (0: all of them)"
    )
    g.add_argument("--seed", type=int, default=1234)
    g = parser.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1, help="Megatron ranks per node (CPU: processes)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU); fp32 otherwise")
    g.add_argument(
        "--colocate",
        action="store_true",
        help="engines on the actor's GPUs: the actor offloads to host memory while they generate, they release "
        "theirs while it trains (SGLang's memory saver); weights go by tensor handles",
    )
    g.add_argument(
        "--update-weight-transport",
        choices=sorted(TRANSPORTS),
        default=None,
        help="weight sync after each step: 'nccl' broadcasts from actor rank 0 to the engines (NCCL on GPU, gloo on "
        "CPU); 'tensor' gives engines on the actor's devices handles to the actor's tensors (CUDA IPC on GPU, shared "
        "memory on CPU); 'disk' writes an HF checkpoint the engines load. Default: tensor with --colocate, nccl with "
        "engines on GPUs of their own, disk otherwise",
    )
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="bytes per weight-sync bucket")
    add_engine_arguments(parser)
    add_prompt_arguments(parser)
    g = parser.add_argument_group("data and rollout")
    g.add_argument("--prompt-data", required=True)
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, required=True, help="rollouts (each followed by training)")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step (default: all)")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--over-sampling-filter-zero-std", action="store_true")
    g.add_argument("--rollout-concurrency", type=int, default=256, help="trajectories generated at once, at most")
    g.add_argument(
        "--async-mode",
        choices=ASYNC_MODES,
        default="off",
        help="off: generate, then train; one-step: the rollout of step k+1 is generated by the weights of step k "
        "while the actor trains on step k; fully: trajectories stream continuously and survive weight pushes "
        "(partial rollouts), a group admitted only while it starts at most --max-staleness versions behind",
    )
    g.add_argument("--max-staleness", type=int, default=2, help="--async-mode fully: versions a group may lag")
    g = parser.add_argument_group("training")
    g.add_argument("--loss-type", default="policy_loss", choices=["policy_loss", "sft"])
    g.add_argument("--advantage-estimator", default="grpo", choices=["grpo", "dr_grpo"])
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=0.28)
    g.add_argument("--use-kl-loss", action="store_true", help="KL to the reference model (--kl-loss-coef)")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", default="low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"])
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling against the engine")
    g.add_argument("--tis-cap", type=float, default=2.0)
    g.add_argument("--optimizer", default="adam", choices=["adam"])
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.98)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--max-tokens-per-gpu", type=int, default=4096, help="token budget of a packed micro-batch")
    g = parser.add_argument_group("evaluation and logging")
    g.add_argument("--eval-prompt-data", nargs="+", default=[], metavar="NAME PATH", help="pairs of name and path")
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--log-rollout-examples", type=int, default=4, help="rollouts kept per step for the report")
    g.add_argument("--use-wandb", action="store_true")
    g.add_argument("--wandb-project", default="slime-search")
    g.add_argument("--wandb-group", default=None)
    add_search_r1_arguments(parser)
    add_model_arguments(parser, required=False)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; nothing is derived or changed here (that is `run_config`'s)."""
    args = build_parser().parse_args(argv)
    eval_sets(args)
    if args.loss_type == "sft" and args.eval_prompt_data:
        raise SystemExit("--loss-type sft trains on another engine's samples; evaluate the policy in the RL run")
    if args.use_kl_loss and args.loss_type == "sft":
        raise SystemExit("--use-kl-loss applies to --loss-type policy_loss")
    if args.kl_loss_coef and not args.use_kl_loss:
        raise SystemExit("--kl-loss-coef needs --use-kl-loss (the reference model is loaded only then)")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is not None and (args.global_batch_size <= 0 or samples % args.global_batch_size):
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} must divide the {samples} samples of a rollout "
            "(--rollout-batch-size x --n-samples-per-prompt)"
        )
    if args.update_weight_buffer_size <= 0:
        raise SystemExit("--update-weight-buffer-size must be a positive number of bytes")
    if args.colocate:
        check_colocation(args)
    if args.async_mode != "off" and args.colocate:
        raise SystemExit(
            f"--async-mode {args.async_mode} overlaps generation with training, which needs the engines on GPUs of "
            "their own: colocated engines share the actor's GPUs (drop --colocate, or use --async-mode off)"
        )
    if args.async_mode != "off" and args.loss_type == "sft":
        raise SystemExit("--async-mode applies to RL: in SFT the samples come from another engine, not the policy")
    if args.max_staleness < 1:
        raise SystemExit(f"--max-staleness must be >= 1, got {args.max_staleness}")
    return args


def eval_sets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data NAME PATH [NAME PATH ...] as (name, path) pairs."""
    pairs = args.eval_prompt_data
    if len(pairs) % 2:
        raise SystemExit("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
    return tuple(zip(pairs[::2], pairs[1::2], strict=True))


def weight_transport(args: argparse.Namespace) -> str:
    """--update-weight-transport, or the fastest transport the placement allows."""
    return args.update_weight_transport or default_transport(args.colocate, bool(args.rollout_num_gpus))


def check_colocation(args: argparse.Namespace) -> None:
    """--colocate: the engines this run starts take the actor's devices, one engine GPU per actor GPU."""
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.engine_url:
        raise SystemExit("--colocate shares the actor's devices with engines this run starts; drop --engine-url")
    if args.rollout_num_gpus and args.rollout_num_gpus != actor_gpus:
        raise SystemExit(
            f"--colocate puts the engines on the actor's {actor_gpus} GPUs; --rollout-num-gpus is "
            f"{args.rollout_num_gpus} (leave it out)"
        )
    refused = transport_kind(weight_transport(args)).refused_colocated
    if refused:
        usable = [name for name, kind in sorted(TRANSPORTS.items()) if kind.refused_colocated is None]
        raise SystemExit(f"--colocate: {refused}; use --update-weight-transport {' or '.join(usable)}")


def steps_per_rollout(args: argparse.Namespace) -> int:
    if args.global_batch_size is None:
        return 1
    return args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size


def check_model_flags(args: argparse.Namespace, hf_config) -> None:
    """When ${MODEL_ARGS[@]} is passed, every flag must agree with the HF checkpoint's config.json."""
    from slime_search.backends.megatron.model_args import check_against_hf_config, model_from_args

    if args.num_layers is None:
        return
    shape, options = model_from_args(args)
    check_against_hf_config(shape, options, hf_config)


# ---- typed configs ------------------------------------------------------------------------------------------------
def model_source(args: argparse.Namespace):
    """The actor's architecture and weights, and options the flags set beyond what config.json holds."""
    import torch

    from slime_search.ray.train_group import ModelSource

    overrides = {
        "sequence_parallel": args.sequence_parallel,
        "params_dtype": torch.bfloat16 if args.bf16 else torch.float32,
    }
    return ModelSource(args.hf_checkpoint, args.load, args.use_kl_loss, args.ref_load, overrides)


def actor_config(args: argparse.Namespace, vocab_size: int):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.optimizer import OptimConfig

    return ActorConfig(
        loss=LossConfig(
            loss_type=args.loss_type,
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            kl_coef=args.kl_loss_coef if args.use_kl_loss else 0.0,
            kl_loss_type=args.kl_loss_type,
            entropy_coef=args.entropy_coef,
            use_tis=args.use_tis,
            tis_cap=args.tis_cap,
            temperature=args.rollout_temperature,
            vocab_size=vocab_size,
        ),
        optim=OptimConfig(
            lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_iters=args.lr_decay_iters,
            lr_decay_style=args.lr_decay_style,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            clip_grad=args.clip_grad,
        ),
        max_tokens_per_micro_batch=args.max_tokens_per_gpu,
    )


def engine_config(args: argparse.Namespace, use_gpu: bool, colocated_gpus: int = 0):
    """`colocated_gpus`: the actor's GPUs, which colocated engines take (one engine GPU per actor GPU)."""
    from slime_search.engines.deployment import EngineConfig

    colocated = bool(colocated_gpus) and use_gpu
    return EngineConfig(
        model_path=args.hf_checkpoint,
        engine_url=args.engine_url,
        num_gpus=colocated_gpus if colocated else args.rollout_num_gpus,
        gpus_per_engine=args.rollout_num_gpus_per_engine,
        mem_fraction_static=args.sglang_mem_fraction_static,
        router_port=args.sglang_router_port,
        memory_saver=colocated,
        cpu_engines=args.cpu_engines,
        cpu_max_batch_size=args.engine_max_batch_size,
        health_timeout_s=args.engine_health_timeout,
        seed=args.seed,
    )


def sampling_params(args: argparse.Namespace, greedy: bool = False) -> dict[str, Any]:
    return {
        "temperature": 0.0 if greedy else args.rollout_temperature,
        "top_p": 1.0 if greedy else args.rollout_top_p,
        "max_new_tokens": args.rollout_max_response_len,
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
        log_dir=args.save,
    )


@dataclass(frozen=True)
class RunConfig:
    """Everything the driver hands to the components, built once from the flags."""

    run_dir: str
    num_rollout: int
    save_interval: int  # 0: only at the end
    keep_checkpoints: int  # 0: every checkpoint
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

    def eval_due(self, version: int) -> bool:
        if not self.rollout.eval_sets or not self.serves_policy:
            return False
        return version == self.num_rollout or bool(self.eval_interval and version % self.eval_interval == 0)

    def save_due(self, steps_done: int) -> bool:
        return steps_done == self.num_rollout or bool(self.save_interval and steps_done % self.save_interval == 0)


def run_config(args: argparse.Namespace, vocab_size: int, use_gpu: bool) -> RunConfig:
    from pathlib import Path

    from slime_search.ray.train_group import TrainGroupConfig
    from slime_search.rollout.schedule import ScheduleConfig
    from slime_search.weight_sync.transports import WeightSyncConfig

    if args.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints must be >= 0 (0 keeps all), got {args.keep_checkpoints}")
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    engines = engine_config(args, use_gpu, colocated_gpus=actor_gpus if args.colocate else 0)
    return RunConfig(
        run_dir=args.save,
        num_rollout=args.num_rollout,
        save_interval=args.save_interval,
        keep_checkpoints=args.keep_checkpoints,
        eval_interval=args.eval_interval,
        log_rollout_examples=args.log_rollout_examples,
        colocate=args.colocate,
        serves_policy=args.loss_type != "sft",
        steps_per_rollout=steps_per_rollout(args),
        train_group=TrainGroupConfig(actor_gpus, args.tensor_model_parallel_size, use_gpu=use_gpu),
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
        schedule=ScheduleConfig(args.async_mode, args.max_staleness),
        wandb=(args.use_wandb, args.wandb_project, args.wandb_group),
    )
