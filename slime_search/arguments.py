"""Command-line flags with slime's names, and their conversion into each component's typed config.

Each flag is declared once, as a field of the config class it sets (`slime_search.config`, utils.flag_fields); this
module puts the classes' flags into argparse groups. The driver parses once (`parse_args`, which validates: it builds
the typed configs, whose construction checks them) and builds every config once (`run_config`); the parsed flags are
never changed afterwards. The plugins still receive the flags as `args` (slime's plugin contract), with
the engines' address added by the RolloutManager on a copy. Argument groups are shared with the eval CLI.
"""

from __future__ import annotations

import argparse
from functools import partial

from slime_search.backends.megatron.model_args import add_model_arguments
from slime_search.compat.flags import add_slime_flags, apply_slime_flags, unknown_flags_message
from slime_search.config.checkpoints import CheckpointConfig
from slime_search.config.cluster import ClusterConfig
from slime_search.config.engines import EngineConfig
from slime_search.config.logs import LogConfig
from slime_search.config.lora import LoraConfig
from slime_search.config.loss import LossConfig
from slime_search.config.optim import OptimConfig
from slime_search.config.rollout import DataConfig, RolloutConfig, RolloutManagerConfig, SamplingConfig
from slime_search.config.training import ImportanceWeightsConfig, TrainingConfig
from slime_search.evaluation.flags import add_evaluation_arguments
from slime_search.evaluation.subsets import add_eval_subset_arguments
from slime_search.health.config import add_health_arguments
from slime_search.parallel_layout import check_layout, widths_from_flags
from slime_search.rollout.schedule import ScheduleConfig
from slime_search.run.config import TypedFlags, typed_flags, weight_transport
from slime_search.search_r1.config import add_search_r1_arguments
from slime_search.utils.flag_fields import add_flags, from_flags
from slime_search.weight_sync.transports import TRANSPORTS, transport_kind


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("engines"), EngineConfig)


PROMPT_FLAGS = {  # the flags of the prompt rows and the plugins, shared with the eval CLI
    DataConfig: ("input_key", "label_key", "apply_chat_template"),
    SamplingConfig: ("max_new_tokens",),
    RolloutConfig: ("reward_key",),
    RolloutManagerConfig: ("generate_path", "reward_path"),
}


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """How prompt rows are read and which plugins turn them into scored samples."""
    g = parser.add_argument_group("prompts and plugins")
    for config_class, names in PROMPT_FLAGS.items():
        add_flags(g, config_class, only=names)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The loss, the importance weights against the engine's sampling, and the optimizer (slime's names; slime's
    spellings are accepted where ours differ)."""
    g = parser.add_argument_group("training")
    add_flags(g, LossConfig)
    add_flags(g, TrainingConfig, skip=RUN_LENGTH_FLAGS)
    add_flags(g, ImportanceWeightsConfig)
    add_flags(g, OptimConfig)
    add_flags(parser.add_argument_group("LoRA (miles' names)"), LoraConfig)


RUN_LENGTH_FLAGS = ("num_rollout", "global_batch_size")  # TrainingConfig's, in the help's data and rollout group


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="slime-search: GRPO training of a search-calling LLM")
    add_flags(parser.add_argument_group("checkpoints"), CheckpointConfig)
    add_flags(parser.add_argument_group("cluster"), ClusterConfig)
    add_engine_arguments(parser)
    add_prompt_arguments(parser)
    g = parser.add_argument_group("data and rollout")
    add_flags(g, DataConfig, skip=PROMPT_FLAGS[DataConfig])
    add_flags(g, TrainingConfig, only=RUN_LENGTH_FLAGS)
    add_flags(g, RolloutConfig, skip=PROMPT_FLAGS[RolloutConfig])
    add_flags(g, SamplingConfig, skip=PROMPT_FLAGS[SamplingConfig])
    add_flags(g, ScheduleConfig)
    add_training_arguments(parser)
    add_evaluation_arguments(parser)
    add_flags(parser.add_argument_group("logging"), LogConfig)
    add_eval_subset_arguments(parser)
    add_health_arguments(parser)
    add_search_r1_arguments(parser)
    add_model_arguments(parser, required=False)
    add_slime_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate: a value or a combination that cannot work is a usage error naming the flag (exit code 2)
    before anything starts. Nothing is derived or changed here (that is `run_config`'s), but for the keys of
    --custom-config-path, merged first (slime's semantics) so that the checks see them."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.error(unknown_flags_message(extras))
    check_or_exit(parser, args, partial(apply_slime_flags, parser), check_flags, check_engine_flags, check_plugins)
    return args


def check_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace, *checks) -> None:
    """Run each `check(args)`; a ValueError, or a plugin that does not load, is a usage error: argparse's usage line
    and the message, exit code 2."""
    from slime_search.plugins import PluginLoadError

    try:
        for check in checks:
            check(args)
    except (ValueError, PluginLoadError) as err:
        parser.error(str(err))


def check_flags(args: argparse.Namespace) -> None:
    """Training flags that cannot work together; ValueError naming them. (Single values are checked by their
    argparse types, and each config class when `typed_flags` builds it.)"""
    flags = typed_flags(args)
    evaluation, cluster = flags.evaluation, flags.cluster
    sft = args.loss_type == "sft"
    if sft and evaluation.prompt_data:
        raise ValueError("--loss-type sft trains on another engine's samples; evaluate the policy in the RL run")
    if evaluation.engine and (sft or not evaluation.prompt_data):
        raise ValueError("--eval-engine evaluates the policy being trained: it needs --eval-prompt-data and RL")
    if flags.training.use_kl_loss and sft:
        raise ValueError("--use-kl-loss applies to --loss-type policy_loss")
    if args.kl_loss_coef and not flags.training.use_kl_loss:
        raise ValueError("--kl-loss-coef needs --use-kl-loss (the reference model is loaded only then)")
    samples = flags.rollout.batch_size * flags.rollout.n_samples_per_prompt
    global_batch = flags.training.global_batch_size
    if global_batch is not None and samples % global_batch:
        raise ValueError(
            f"--global-batch-size {global_batch} must divide the {samples} samples of a rollout "
            "(--rollout-batch-size x --n-samples-per-prompt)"
        )
    check_layout(args, widths_from_flags(args))
    check_lora(from_flags(LoraConfig, args), cluster, args)
    check_importance_weights(args, flags)
    if cluster.colocate:
        check_colocation(args)
    if args.async_mode != "off" and cluster.colocate:
        raise ValueError(
            f"--async-mode {args.async_mode} overlaps generation with training, which needs the engines on GPUs of "
            "their own: colocated engines share the actor's GPUs (drop --colocate, or use --async-mode off)"
        )
    if args.async_mode != "off" and sft:
        raise ValueError("--async-mode applies to RL: in SFT the samples come from another engine, not the policy")


def check_lora(lora: LoraConfig, cluster: ClusterConfig, args: argparse.Namespace) -> None:
    if not lora.enabled:
        return
    if lora.lora_rank % cluster.tensor_model_parallel_size:
        raise ValueError(
            f"--lora-rank {lora.lora_rank} must be a multiple of --tensor-model-parallel-size "
            f"{cluster.tensor_model_parallel_size}: each adapter is split the way its layer is"
        )
    if cluster.attention_impl == "te":
        raise ValueError("--lora-rank: the adapters wrap Megatron's local linears; use --attention-impl packed")
    if lora.lora_adapter_path:  # read here too, so that a folder that does not fit fails before anything starts
        from slime_search.backends.megatron.lora_peft import read_peft_adapters

        read_peft_adapters(lora.lora_adapter_path, lora)
    if lora.lora_sync_from_tensor:
        check_adapter_sync(args)


def check_adapter_sync(args: argparse.Namespace) -> None:
    """--lora-sync-from-tensor replaces the engines' adapter at each push.

    No request may be in flight then. The engines keep their base weights, also colocated ones (ray.colocation).
    Each engine's LoRA serving is checked when the run connects to it."""
    if args.async_mode == "fully":
        raise ValueError(
            "--lora-sync-from-tensor with --async-mode fully is not supported: requests paused across a push name "
            "the adapter the push replaces (use --async-mode one-step, which drains the rollout before a push)"
        )


def check_importance_weights(args: argparse.Namespace, flags: TypedFlags) -> None:
    importance = flags.importance
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ValueError(f"--eps-clip-c must be > 1 (a bound on -ratio x advantage), got {args.eps_clip_c}")
    if args.use_tis and importance.use_mis:
        raise ValueError("choose --use-tis (vanilla TIS) or --use-mis (the general form), not both")
    if args.use_tis and importance.tis_clip_low >= args.tis_cap:
        raise ValueError(f"--tis-clip-low {importance.tis_clip_low:g} must be below --tis-clip {args.tis_cap:g}")
    if importance.custom_tis_function_path is not None:  # slime calls it in the place of vanilla TIS
        from slime_search.plugins import load_function

        if not args.use_tis:
            raise ValueError(
                "--custom-tis-function-path takes the place of vanilla TIS, as in slime: add --use-tis (slime's "
                "mis.yaml sets use_tis: true through --custom-config-path)"
            )
        if args.loss_type != "policy_loss":
            raise ValueError("--custom-tis-function-path weights the policy loss: use --loss-type policy_loss")
        load_function(importance.custom_tis_function_path)
    if (args.use_tis or importance.use_mis) and flags.sampling.top_p < 1:
        # The engine samples from the nucleus, renormalised; the trainer's log-probs are over the full vocabulary.
        raise ValueError(
            f"--rollout-top-p {flags.sampling.top_p} with --use-tis/--use-mis: the engine's log-probs are of the "
            "truncated distribution and the trainer's of the full one, so the weights would compare different "
            "distributions; use --rollout-top-p 1"
        )


def check_engine_flags(args: argparse.Namespace) -> None:
    """The engines' GPUs split into whole engines (shared with the eval CLI)."""
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise ValueError(
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine}"
        )


def check_plugins(args: argparse.Namespace) -> None:
    """The reward plugin loads, and the generate plugin loads and its module accepts the flags.

    The module accepts them through its optional `check_args` hook. So a bad task flag is found now, and not on the
    first sample after the models loaded."""
    from slime_search.plugins import check_plugin_args, load_function

    load_function(args.custom_rm_path)
    check_plugin_args(args.custom_generate_function_path, args)


def preflight(args: argparse.Namespace) -> None:
    """The generate plugin's optional `preflight` hook: the services it needs answer (the retriever). On a failure
    the CLI exits with its message (exit code 1) before Ray starts and the models load."""
    from slime_search.plugins import run_preflight

    try:
        run_preflight(args.custom_generate_function_path, args)
    except RuntimeError as err:
        raise SystemExit(f"preflight failed: {err}") from None


def check_colocation(args: argparse.Namespace) -> None:
    """--colocate: the engines this run starts take the actor's devices, one engine GPU per actor GPU."""
    actor_gpus = from_flags(ClusterConfig, args).actor_gpus
    if args.engine_url:
        raise ValueError("--colocate shares the actor's devices with engines this run starts; drop --engine-url")
    if args.rollout_num_gpus and args.rollout_num_gpus != actor_gpus:
        raise ValueError(
            f"--colocate puts the engines on the actor's {actor_gpus} GPUs; --rollout-num-gpus is "
            f"{args.rollout_num_gpus} (leave it out)"
        )
    if actor_gpus % args.rollout_num_gpus_per_engine:
        raise ValueError(
            f"--colocate puts the engines on the actor's {actor_gpus} GPUs, not a multiple of "
            f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}"
        )
    refused = transport_kind(weight_transport(args)).refused_colocated
    if refused:
        usable = [name for name, kind in sorted(TRANSPORTS.items()) if kind.refused_colocated is None]
        raise ValueError(f"--colocate: {refused}; use --update-weight-transport {' or '.join(usable)}")


def check_model_flags(args: argparse.Namespace, hf_config) -> None:
    """The layout fits the checkpoint's heads; when ${MODEL_ARGS[@]} is passed, every flag must agree with its
    config.json."""
    from slime_search.backends.megatron.model_args import check_against_hf_config, model_from_args
    from slime_search.parallel_layout import widths_from_hf_config

    check_layout(args, widths_from_hf_config(hf_config))
    if args.num_layers is None:
        return
    shape, options = model_from_args(args)
    check_against_hf_config(shape, options, hf_config)
