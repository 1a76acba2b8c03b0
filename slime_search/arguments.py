"""Command-line flags with slime's names, converted at the boundary into each component's typed config."""

from __future__ import annotations

import argparse

from slime_search.search_r1.config import add_search_r1_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="slime-search: GRPO training of a search-calling LLM")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--hf-checkpoint", required=True, help="HF folder: initial weights, config and tokenizer")
    g.add_argument("--save", required=True, help="run folder: checkpoints, synced weights, metrics")
    g.add_argument("--save-interval", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g = parser.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1, help="Megatron ranks per node")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--rollout-num-engines", type=int, default=1, help="CPU engines (GPU: --rollout-num-gpus)")
    g.add_argument("--engine-max-batch-size", type=int, default=32)
    g = parser.add_argument_group("data and rollout")
    g.add_argument("--prompt-data", required=True)
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--label-key", default="reward_model")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, required=True, help="training steps (one rollout each)")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=int, default=8)
    g.add_argument("--rollout-max-response-len", type=int, default=512, help="max new tokens per turn")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--over-sampling-filter-zero-std", action="store_true")
    g.add_argument("--reward-key", default="score")
    g.add_argument("--custom-generate-function-path", default="slime_search.search_r1.generate.generate")
    g.add_argument("--custom-rm-path", default="slime_search.search_r1.reward.reward_func")
    g = parser.add_argument_group("training")
    g.add_argument("--loss-type", default="policy_loss", choices=["policy_loss", "sft"])
    g.add_argument("--advantage-estimator", default="grpo", choices=["grpo", "dr_grpo"])
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=0.28)
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", default="low_var_kl")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--use-tis", action="store_true")
    g.add_argument("--tis-cap", type=float, default=2.0)
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    g = parser.add_argument_group("evaluation and logging")
    g.add_argument("--eval-prompt-data", nargs="+", default=[], metavar="NAME PATH", help="pairs of name and path")
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--use-wandb", action="store_true")
    add_search_r1_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if len(args.eval_prompt_data) % 2:
        raise SystemExit("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
    if args.kl_loss_coef and args.loss_type == "sft":
        raise SystemExit("--kl-loss-coef applies to --loss-type policy_loss")
    return args


def actor_config(args: argparse.Namespace, vocab_size: int):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.optimizer import OptimConfig

    return ActorConfig(
        loss=LossConfig(
            loss_type=args.loss_type,
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            kl_coef=args.kl_loss_coef,
            kl_loss_type=args.kl_loss_type,
            entropy_coef=args.entropy_coef,
            use_tis=args.use_tis,
            tis_cap=args.tis_cap,
            temperature=args.rollout_temperature,
            vocab_size=vocab_size,
        ),
        optim=OptimConfig(lr=args.lr, clip_grad=args.clip_grad),
        max_tokens_per_micro_batch=args.max_tokens_per_gpu,
    )


def rollout_config(args: argparse.Namespace):
    from slime_search.rollout.rollout import RolloutConfig

    return RolloutConfig(
        batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.n_samples_per_prompt,
        filter_zero_std=args.over_sampling_filter_zero_std,
        reward_key=args.reward_key,
        normalize_advantages_std=args.advantage_estimator == "grpo",
    )


def sampling_params(args: argparse.Namespace, greedy: bool = False) -> dict:
    return {
        "temperature": 0.0 if greedy else args.rollout_temperature,
        "top_p": 1.0 if greedy else args.rollout_top_p,
        "max_new_tokens": args.rollout_max_response_len,
    }
