"""Evaluate a checkpoint (or a running engine) on Search-R1 test sets: EM / sub-EM / F1 per data source.

    python -m slime_search.eval --hf-checkpoint CKPT --eval-prompt-data nq data/test.parquet \
        --search-url http://127.0.0.1:8000/retrieve --apply-chat-template --output eval.json

Greedy decoding through the same generate / reward plugins as training; the metrics are the reward's numeric keys
per data source (slime_search.rollout.evaluation). With --hf-checkpoint alone an engine is started (the CPU engine
server; SGLang on GPU with --rollout-num-gpus); --engine-url uses a running one. The CPU engine's log goes beside
--output (eval.json -> eval.logs/), or without --output to a temporary folder that is removed after a successful run;
the folder is named at the start, and again if the evaluation fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from slime_search.arguments import add_engine_arguments, add_prompt_arguments
    from slime_search.search_r1.config import add_search_r1_arguments
    from slime_search.utils.flag_types import non_negative_int, positive_int

    parser = argparse.ArgumentParser(description="evaluate a search-calling policy on QA sets")
    parser.add_argument("--hf-checkpoint", required=True, help="HF folder: tokenizer (and weights to serve)")
    parser.add_argument(
        "--eval-prompt-data", nargs="+", required=True, metavar="NAME PATH", help="pairs of name and path"
    )
    parser.add_argument("--max-samples", type=positive_int, default=None, help="first N rows of each set")
    parser.add_argument(
        "--seed", type=non_negative_int, default=1234, help="seeds the engines' sampling (engine i: seed + i)"
    )
    parser.add_argument("--output", default=None, help="write the metrics here (json) and the samples beside it")
    add_engine_arguments(parser)
    add_prompt_arguments(parser)
    add_search_r1_arguments(parser)
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


def work_folder(output: str | None) -> tuple[Path, bool]:
    """Where the engine logs and the --max-samples files go, and whether it is a temporary folder: beside --output
    (eval.json -> eval.logs/), kept with the results; else a new temporary folder, removed after a successful run."""
    if output:
        work = Path(output).with_suffix(".logs")
        work.mkdir(parents=True, exist_ok=True)
        return work, False
    import tempfile

    return Path(tempfile.mkdtemp(prefix="slime-search-eval-")), True


def evaluate(args: argparse.Namespace, work: Path) -> list:
    """The evaluated samples of every set, with the engines (CPU engine logs in `work`) started for it and stopped
    after; the --max-samples files written to `work` are removed at the end."""
    import torch

    from slime_search.arguments import eval_sets
    from slime_search.engines.deployment import start_engines
    from slime_search.plugins import Plugins
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import evaluation_samples, plugin_args_for, run_rollout
    from slime_search.run_config import engine_config, sampling_params

    sets = tuple((name, limited(path, args.max_samples, work)) for name, path in eval_sets(args))
    try:
        plugins = Plugins.load(args.custom_generate_function_path, args.custom_rm_path)
        engines = start_engines(engine_config(args, use_gpu=torch.cuda.is_available()), work)
        plugin_args = plugin_args_for(args, engines)

        def run(source, config, params):
            return run_rollout(plugins, plugin_args, source, config, params)

        try:
            data = DataConfig("", args.input_key, args.label_key)
            return evaluation_samples(sets, data, args.reward_key, run, sampling_params(args, greedy=True))
        finally:
            engines.stop()
    finally:
        if args.max_samples is not None:  # the paths are the copies limited() made, not the user's files
            for _, path in sets:
                Path(path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    import shutil

    from slime_search.arguments import check_engine_flags, check_or_exit, check_plugins, eval_sets, preflight
    from slime_search.rollout.evaluation import evaluate_samples

    parser = build_parser()
    args = parser.parse_args(argv)
    check_or_exit(parser, args, eval_sets, check_engine_flags, check_plugins)  # usage errors before anything starts
    preflight(args)
    work, temporary = work_folder(args.output)
    print(f"engine logs and --max-samples files in {work}", file=sys.stderr)
    try:
        samples = evaluate(args, work)
    except BaseException:
        print(f"evaluation failed; the engine logs are kept in {work}", file=sys.stderr)
        raise
    if temporary:
        shutil.rmtree(work, ignore_errors=True)
    elif not any(work.iterdir()):  # nothing was started here (--engine-url): no empty folder beside the results
        work.rmdir()
    metrics = evaluate_samples(samples, args.reward_key)
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
