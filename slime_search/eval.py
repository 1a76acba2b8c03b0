"""Evaluate a checkpoint (or a running engine) on Search-R1 test sets: EM / sub-EM / F1 per data source.

    python -m slime_search.eval --hf-checkpoint CKPT --eval-prompt-data nq data/test.parquet \
        --search-url http://127.0.0.1:8000/retrieve --apply-chat-template --output eval.json

Greedy decoding through the same generate / reward plugins as training. With --hf-checkpoint alone an engine is
started (the CPU engine server; SGLang on GPU with --rollout-num-gpus); --engine-url uses a running one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from slime_search.search_r1.config import add_search_r1_arguments

    parser = argparse.ArgumentParser(description="evaluate a search-calling policy on QA sets")
    parser.add_argument("--hf-checkpoint", required=True, help="HF folder: tokenizer (and weights to serve)")
    parser.add_argument("--engine-url", default=None, help="a running SGLang-API engine (else one is started)")
    parser.add_argument("--eval-prompt-data", nargs="+", required=True, metavar="NAME PATH")
    parser.add_argument("--input-key", default="prompt")
    parser.add_argument("--label-key", default="reward_model")
    parser.add_argument("--apply-chat-template", action="store_true")
    parser.add_argument("--rollout-max-response-len", type=int, default=512, help="max new tokens per turn")
    parser.add_argument("--max-samples", type=int, default=None, help="first N rows of each set")
    parser.add_argument("--rollout-num-gpus", type=int, default=0)
    parser.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    parser.add_argument("--sglang-mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--engine-max-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", default=None, help="write the metrics here (json) and the samples beside it")
    parser.add_argument("--custom-generate-function-path", default="slime_search.search_r1.generate.generate")
    parser.add_argument("--custom-rm-path", default="slime_search.search_r1.reward.reward_func")
    add_search_r1_arguments(parser)
    # what the rollout code reads from training flags, fixed for evaluation
    parser.set_defaults(
        sglang_router_port=0,
        reward_key="score",
        rollout_temperature=0.0,
        rollout_top_p=1.0,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
        over_sampling_filter_zero_std=False,
        advantage_estimator="grpo",
    )
    return parser


def limited(path: str, max_samples: int | None, out_dir: Path) -> str:
    """The eval file itself, or its first `max_samples` rows written as jsonl."""
    if max_samples is None:
        return path
    from slime_search.rollout.data_source import load_rows

    rows = load_rows(path)[:max_samples]
    target = out_dir / (Path(path).stem + f".first{max_samples}.jsonl")
    target.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    return str(target)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from slime_search.arguments import sampling_params
    from slime_search.evaluation import evaluate_samples
    from slime_search.plugins import load_function
    from slime_search.ray.rollout_manager import evaluation_samples, run_rollout, start_engines

    args = build_parser().parse_args(argv)
    if len(args.eval_prompt_data) % 2:
        raise SystemExit("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
    work = Path(tempfile.mkdtemp(prefix="slime-search-eval-"))
    names, paths = args.eval_prompt_data[::2], args.eval_prompt_data[1::2]
    args.eval_prompt_data = [
        x for n, p in zip(names, paths, strict=True) for x in (n, limited(p, args.max_samples, work))
    ]
    generate, reward = load_function(args.custom_generate_function_path), load_function(args.custom_rm_path)
    engines = start_engines(args, work)
    args.engine_url = engines.url

    def run(source, config, params):
        return run_rollout(args, source, config, generate, reward, params)

    try:
        samples = evaluation_samples(args, run, sampling_params(args, greedy=True))
    finally:
        engines.stop()
    metrics = evaluate_samples(samples)
    for key in sorted(metrics):
        print(f"{key:40s} {metrics[key]:.4f}")
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(metrics, indent=1))
        with open(out.with_suffix(".samples.jsonl"), "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample.to_dict(), default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
