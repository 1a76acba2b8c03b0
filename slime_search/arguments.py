"""Command-line flags with slime's names, and their conversion into each component's typed config.

The driver parses once (`parse_args`, which only validates) and builds every config once (`run_config`); the parsed
flags are never changed afterwards. The plugins still receive the flags as `args` (slime's plugin contract), with
the engines' address added by the RolloutManager on a copy. Argument groups are shared with the eval CLI.
"""

from __future__ import annotations

import argparse
from functools import partial

from slime_search.compat.flags import add_slime_flags, apply_slime_flags, no_save_hf_path, unknown_flags_message
from slime_search.config.engines import EngineConfig
from slime_search.evaluation.flags import add_evaluation_arguments
from slime_search.evaluation.subsets import add_eval_subset_arguments
from slime_search.health.config import add_health_arguments, health_config
from slime_search.parallel_layout import check_layout, widths_from_flags
from slime_search.rollout.schedule import ScheduleConfig
from slime_search.search_r1.config import add_search_r1_arguments
from slime_search.utils.flag_fields import add_flags
from slime_search.utils.flag_types import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from slime_search.weight_sync.transports import TRANSPORTS, default_transport, transport_kind


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engines")
    add_flags(g, EngineConfig)
    g.add_argument(
        "--cpu-engine-args",
        default="",
        help="more arguments for every CPU engine server this run starts, as one string: its injected faults "
        "(--decode-delay-ms, --freeze-weights-after) for measuring the health guard; write it "
        "--cpu-engine-args='--decode-delay-ms 20' (with '=': the value starts with --)",
    )


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """How prompt rows are read and which plugins turn them into scored samples."""
    g = parser.add_argument_group("prompts and plugins")
    g.add_argument("--input-key", default="prompt", help="column of a prompt row that holds the prompt")
    g.add_argument("--label-key", default="reward_model", help="column of a prompt row that holds the label")
    g.add_argument(
        "--apply-chat-template", action="store_true", help="render the prompt with the tokenizer's chat template"
    )
    g.add_argument("--rollout-max-response-len", type=positive_int, default=512, help="max new tokens per turn")
    g.add_argument("--reward-key", default="score", help="key of the reward plugin's dict that is the reward")
    g.add_argument(
        "--custom-generate-function-path",
        default="slime_search.search_r1.generate.generate",
        help="the generate plugin, by dotted path: async generate(args, sample, sampling_params) -> Sample",
    )
    g.add_argument(
        "--custom-rm-path",
        default="slime_search.search_r1.reward.reward_func",
        help="the reward plugin, by dotted path: async reward_func(args, sample) -> float | dict",
    )


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The loss, the importance weights against the engine's sampling, and the optimizer (slime's names; slime's
    spellings are accepted where ours differ)."""
    g = parser.add_argument_group("training")
    from slime_search.config.loss import LossConfig

    add_flags(g, LossConfig)
    g.add_argument(
        "--advantage-estimator",
        default="grpo",
        choices=["grpo", "dr_grpo"],
        help="grpo: reward minus its group's mean, divided by the group's std; dr_grpo: not divided",
    )
    g.add_argument(
        "--disable-grpo-std-normalization",
        dest="advantage_estimator",
        action="store_const",
        const="dr_grpo",
        help="slime's spelling of --advantage-estimator dr_grpo",
    )
    g.add_argument("--use-kl-loss", action="store_true", help="KL to the reference model (--kl-loss-coef)")
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="average the loss over every response token of the step (token_mean); default: over each sequence's "
        "tokens, then over the sequences (sequence_mean)",
    )
    g.add_argument(
        "--tis-clip-low", type=non_negative_float, default=0.0, help="lower clamp of the TIS weights (0: none)"
    )
    g.add_argument(
        "--custom-tis-function-path",
        default=None,
        help="module.function in place of vanilla TIS, with --use-tis (slime's): called on every micro-batch as "
        "fn(args, pg_loss=..., train_log_probs=[...], rollout_log_probs=[...], loss_masks=[...], total_lengths=[...], "
        "response_lengths=[...]) -> (weighted pg_loss, masks, metrics); tokens its masks take out leave the loss, its "
        "metrics are logged as train/NAME. slime's TIS/MIS helper: examples.train_infer_mismatch_helper.mis."
        "compute_mis_weights_with_cp with --custom-config-path .../mis.yaml",
    )
    from slime_search.algo.importance import IS_LEVELS, IS_MODES

    g.add_argument(
        "--use-mis",
        action="store_true",
        help="importance weights in their general form (--mis-level, --mis-mode, bounds), normalised to mean 1 over "
        "the global batch: every micro-batch and data-parallel rank of the optimizer step together (instead of "
        "--use-tis)",
    )
    g.add_argument(
        "--mis-level",
        choices=IS_LEVELS,
        default="token",
        help="token: a weight per token; sequence: the product of the response's ratios; geometric: their "
        "geometric mean",
    )
    g.add_argument(
        "--mis-mode",
        choices=IS_MODES,
        default="truncate",
        help="truncate: min(w, upper); clip: clamp(w, lower, upper); mask: tokens with w outside [lower, upper] "
        "leave the loss",
    )
    g.add_argument("--mis-upper", type=positive_float, default=2.0, help="upper bound of the MIS weights")
    g.add_argument(
        "--mis-lower",
        type=non_negative_float,
        default=None,
        help="lower bound of the MIS weights (default: 1 / --mis-upper)",
    )
    g.add_argument(
        "--mis-veto-threshold",
        type=positive_float,
        default=None,
        help="a sequence holding a token whose ratio is below this leaves the loss (default: off)",
    )
    g.add_argument(
        "--mis-batch-normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="normalise the MIS weights to mean 1 over the global batch",
    )
    from slime_search.config.optim import OptimConfig

    add_flags(g, OptimConfig)
    g.add_argument("--max-tokens-per-gpu", type=positive_int, default=4096, help="token budget of a packed micro-batch")


def build_parser() -> argparse.ArgumentParser:
    from slime_search.backends.megatron.model_args import add_model_arguments

    parser = argparse.ArgumentParser(description="slime-search: GRPO training of a search-calling LLM")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--hf-checkpoint", required=True, help="HF folder: architecture, tokenizer, initial weights")
    g.add_argument("--load", default=None, help="torch_dist folder with the initial actor weights (else the HF ones)")
    g.add_argument("--ref-load", default=None, help="torch_dist folder of the KL reference (else the initial weights)")
    g.add_argument("--save", required=True, help="run folder: checkpoints, synced weights, metrics, report")
    g.add_argument(
        "--save-interval", type=non_negative_int, default=0, help="checkpoint every N steps (0: only at the end)"
    )
    g.add_argument(
        "--keep-checkpoints",
        type=non_negative_int,
        default=2,
        help="newest checkpoints kept in SAVE/checkpoints (0: all of them)",
    )
    g.add_argument(
        "--save-hf",
        nargs="?",
        const=True,
        default=False,
        type=no_save_hf_path,
        help="also write each checkpoint's weights as an HF folder (SAVE/hf/step_N: weights, config, tokenizer), "
        "kept and pruned with its checkpoint",
    )
    g.add_argument(
        "--seed",
        type=non_negative_int,
        default=1234,
        help="seeds the actor's RNGs (Python, NumPy, torch, Megatron's model-parallel RNG) and the engines' sampling "
        "(engine i: seed + i)",
    )
    g = parser.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=positive_int, default=1, help="nodes of the Megatron actor")
    g.add_argument(
        "--actor-num-gpus-per-node", type=positive_int, default=1, help="Megatron ranks per node (CPU: processes)"
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=positive_int,
        default=1,
        help="Megatron tensor-parallel size; must divide the actor's ranks (the rest is data parallel)",
    )
    g.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence parallelism (with tensor parallelism)"
    )
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU); fp32 otherwise")
    g.add_argument(
        "--attention-impl",
        choices=["auto", "te", "local", "packed"],
        default="auto",
        help="the actor's attention: 'te' TransformerEngine's layer spec; 'packed' Megatron's local spec attending "
        "within each packed sample through torch's SDPA (memory linear in the packed length); 'local' Megatron's "
        "local attention, which scores a packed row whole (quadratic); 'auto': te where TransformerEngine is "
        "installed and CUDA present, else packed",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Megatron activation recomputation: full layers (with --recompute-method and --recompute-num-layers) "
        "or selective (the core attention, whose scores the local attention without TransformerEngine keeps whole)",
    )
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None, help="with full recompute")
    g.add_argument(
        "--recompute-num-layers", type=positive_int, default=None, help="layers per recompute unit (full recompute)"
    )
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
    g.add_argument(
        "--update-weight-buffer-size", type=positive_int, default=512 * 1024**2, help="bytes per weight-sync bucket"
    )
    add_engine_arguments(parser)
    add_prompt_arguments(parser)
    g = parser.add_argument_group("data and rollout")
    g.add_argument("--prompt-data", required=True, help="training prompts: parquet or jsonl, Search-R1's schema")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle the prompts every epoch")
    g.add_argument(
        "--rollout-seed",
        type=non_negative_int,
        default=42,
        help="seed of the prompt order and of each trajectory's sampling (on engines that seed it: the CPU engine, "
        "SGLang with --enable-deterministic-inference)",
    )
    g.add_argument(
        "--num-rollout",
        type=non_negative_int,
        required=True,
        help="rollouts, each followed by training (0: no training, only the final evaluation of the start weights)",
    )
    g.add_argument("--rollout-batch-size", type=positive_int, required=True, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=positive_int, default=8, help="samples per prompt: one GRPO group")
    g.add_argument(
        "--global-batch-size",
        type=positive_int,
        default=None,
        help="samples per optimizer step (default: all the rollout's, one step per rollout)",
    )
    g.add_argument(
        "--rollout-temperature",
        type=positive_float,
        default=1.0,
        help="sampling temperature of the rollouts, > 0: the trainer divides its logits by it to recompute the "
        "log-probs the engine sampled with (greedy decoding has no such distribution; evaluation is greedy anyway)",
    )
    g.add_argument(
        "--rollout-top-p",
        type=probability,
        default=1.0,
        help="nucleus sampling of the rollouts, in (0, 1]; below 1 the engine samples from a truncated distribution "
        "while the trainer's log-probs are over the full vocabulary, so --use-tis / --use-mis are refused with it",
    )
    g.add_argument(
        "--over-sampling-filter-zero-std",
        action="store_true",
        help="drop groups whose rewards are all equal (no GRPO signal) and generate more in their place",
    )
    g.add_argument(
        "--rollout-concurrency", type=positive_int, default=256, help="trajectories generated at once, at most"
    )
    add_flags(g, ScheduleConfig)
    add_training_arguments(parser)
    add_evaluation_arguments(parser)
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-rollout-examples", type=non_negative_int, default=4, help="rollouts kept per step for the report"
    )
    g.add_argument("--use-wandb", action="store_true", help="also log to wandb (offline without an API key)")
    g.add_argument("--wandb-project", default="slime-search", help="wandb project")
    g.add_argument("--wandb-group", default=None, help="wandb group")
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
    argparse types.)"""
    eval_sets(args)
    if args.loss_type == "sft" and args.eval_prompt_data:
        raise ValueError("--loss-type sft trains on another engine's samples; evaluate the policy in the RL run")
    if args.eval_engine_url and not args.eval_engine:
        raise ValueError("--eval-engine-url names the engine of --eval-engine; add --eval-engine")
    if args.eval_engine and (args.loss_type == "sft" or not args.eval_prompt_data):
        raise ValueError("--eval-engine evaluates the policy being trained: it needs --eval-prompt-data and RL")
    if args.use_kl_loss and args.loss_type == "sft":
        raise ValueError("--use-kl-loss applies to --loss-type policy_loss")
    if args.kl_loss_coef and not args.use_kl_loss:
        raise ValueError("--kl-loss-coef needs --use-kl-loss (the reference model is loaded only then)")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is not None and samples % args.global_batch_size:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must divide the {samples} samples of a rollout "
            "(--rollout-batch-size x --n-samples-per-prompt)"
        )
    check_layout(args, widths_from_flags(args))
    check_recompute(args)
    check_importance_weights(args)
    health_config(args)  # the guard's bounds that only make sense together
    if args.colocate:
        check_colocation(args)
    if args.async_mode != "off" and args.colocate:
        raise ValueError(
            f"--async-mode {args.async_mode} overlaps generation with training, which needs the engines on GPUs of "
            "their own: colocated engines share the actor's GPUs (drop --colocate, or use --async-mode off)"
        )
    if args.async_mode != "off" and args.loss_type == "sft":
        raise ValueError("--async-mode applies to RL: in SFT the samples come from another engine, not the policy")


def check_recompute(args: argparse.Namespace) -> None:
    """Megatron's rules for activation recomputation, said at start-up with the flags' names."""
    granularity, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if granularity != "full" and (method or layers):
        raise ValueError("--recompute-method and --recompute-num-layers go with --recompute-granularity full only")
    if granularity == "full" and (method is None or layers is None):
        raise ValueError("--recompute-granularity full needs --recompute-method and --recompute-num-layers")


def check_importance_weights(args: argparse.Namespace) -> None:
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ValueError(f"--eps-clip-c must be > 1 (a bound on -ratio x advantage), got {args.eps_clip_c}")
    if args.use_tis and args.use_mis:
        raise ValueError("choose --use-tis (vanilla TIS) or --use-mis (the general form), not both")
    if args.use_tis and args.tis_clip_low >= args.tis_cap:
        raise ValueError(f"--tis-clip-low {args.tis_clip_low:g} must be below --tis-clip {args.tis_cap:g}")
    if args.use_mis:
        lower = args.mis_lower if args.mis_lower is not None else 1.0 / args.mis_upper
        if lower >= args.mis_upper:
            given = f"{lower:g}" if args.mis_lower is not None else f"(by default 1 / --mis-upper = {lower:g})"
            raise ValueError(f"--mis-lower {given} must be below --mis-upper {args.mis_upper:g}")
    if args.custom_tis_function_path is not None:  # slime calls it in the place of vanilla TIS, in the policy loss
        from slime_search.plugins import load_function

        if not args.use_tis:
            raise ValueError(
                "--custom-tis-function-path takes the place of vanilla TIS, as in slime: add --use-tis (slime's "
                "mis.yaml sets use_tis: true through --custom-config-path)"
            )
        if args.loss_type != "policy_loss":
            raise ValueError("--custom-tis-function-path weights the policy loss: use --loss-type policy_loss")
        load_function(args.custom_tis_function_path)
    if (args.use_tis or args.use_mis) and args.rollout_top_p < 1:
        # The engine samples from the nucleus, renormalised; the trainer's log-probs are over the full vocabulary.
        raise ValueError(
            f"--rollout-top-p {args.rollout_top_p} with --use-tis/--use-mis: the engine's log-probs are of the "
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
    """The reward plugin loads, and the generate plugin loads and its module accepts the flags (its optional
    `check_args` hook), so a bad task flag is found now and not on the first sample, after the models loaded."""
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


def eval_sets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--eval-prompt-data NAME PATH [NAME PATH ...] as (name, path) pairs."""
    pairs = args.eval_prompt_data
    if len(pairs) % 2:
        raise ValueError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
    return tuple(zip(pairs[::2], pairs[1::2], strict=True))


def weight_transport(args: argparse.Namespace) -> str:
    """--update-weight-transport, or the fastest transport the placement allows."""
    return args.update_weight_transport or default_transport(args.colocate, bool(args.rollout_num_gpus))


def check_colocation(args: argparse.Namespace) -> None:
    """--colocate: the engines this run starts take the actor's devices, one engine GPU per actor GPU."""
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
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


def steps_per_rollout(args: argparse.Namespace) -> int:
    if args.global_batch_size is None:
        return 1
    return args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size


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
