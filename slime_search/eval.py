"""Evaluate a checkpoint (or a running engine) on Search-R1 test sets, or compare two runs question by question.

The evaluation prints the paper's table: EM per set and the average, F1, search rate, turns and format-valid rate.
Each EM comes with its 95% bootstrap interval about the population of questions. A set graded in part also gets one
about the whole set's EM. The comparison of two runs pairs them by data row, never by prompt text, which two questions
may share.

    python -m slime_search.eval --hf-checkpoint CKPT --eval-prompt-data nq data/nq_test.parquet ... \
        --search-url http://127.0.0.1:8000/retrieve --apply-chat-template --output eval.json
    python -m slime_search.eval --grade trajectories.jsonl [...] --output graded.json    # graded as they stand
    python -m slime_search.eval --compare A.grades.jsonl B.grades.jsonl                   # paired bootstrap, A - B

Decoding is greedy, through the same generate / reward plugins as training. The metrics are the reward's numeric
keys per data source (slime_search.rollout.eval_metrics). With --hf-checkpoint alone an engine is started (the CPU
engine server; SGLang on GPU with --rollout-num-gpus); --engine-url uses a running one. The CPU engine's log goes
beside --output (eval.json -> eval.logs/). Without --output it goes to a temporary folder that is removed after a
successful run. That folder is named at the start, and again if the evaluation fails. Beside eval.json go the samples
(eval.samples.jsonl) and one graded row per question (eval.grades.jsonl, what --compare pairs). The table goes there
too (eval.table.md, eval.table.json). --eval-sample N or --eval-interval-width W grades a fixed draw of each set.
--grade grades trajectory files (response, golden answers, set) or earlier samples with the reward plugin, no engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from slime_search.arguments import add_engine_arguments, add_prompt_arguments
    from slime_search.evaluation.flags import EvalConfig
    from slime_search.evaluation.subsets import add_eval_subset_arguments
    from slime_search.search_r1.config import add_search_r1_arguments
    from slime_search.utils.flag_fields import add_flags
    from slime_search.utils.flag_types import non_negative_float, non_negative_int, positive_int

    parser = argparse.ArgumentParser(description="evaluate a search-calling policy on QA sets")
    parser.add_argument("--hf-checkpoint", default=None, help="HF folder: tokenizer (and weights to serve)")
    add_flags(parser, EvalConfig, only=("prompt_data",))
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--grade", nargs="+", default=None, metavar="FILE", help="grade trajectories or samples")
    modes.add_argument(
        "--compare", nargs=2, default=None, metavar=("A", "B"), help="A - B on the questions both graded, paired"
    )
    parser.add_argument("--compare-metric", default="em", choices=["em", "f1"], help="what --compare compares")
    parser.add_argument("--interval-seed", type=non_negative_int, default=0, help="seeds the bootstrap resampling")
    parser.add_argument("--max-samples", type=positive_int, default=None, help="first N rows of each set")
    parser.add_argument(
        "--seed", type=non_negative_int, default=1234, help="seeds the engines' sampling (engine i: seed + i)"
    )
    parser.add_argument("--output", default=None, help="write the metrics here (json) and the samples beside it")
    judge = parser.add_argument_group("LLM judge (off unless --judge-url is given)")
    judge.add_argument(
        "--judge-url", default=None, help="an OpenAI-compatible endpoint, e.g. https://api.openai.com/v1"
    )
    judge.add_argument("--judge-model", default=None, help="the judge's model name at that endpoint")
    judge.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="the environment variable with its key")
    judge.add_argument(
        "--judge-cache", default=None, help="SQLite file of verdicts (default: beside --output, else ~/.cache)"
    )
    judge.add_argument("--judge-concurrency", type=positive_int, default=8, help="requests in flight")
    judge.add_argument("--judge-usd-per-million-input", type=non_negative_float, default=0.0, help="for the cost")
    judge.add_argument("--judge-usd-per-million-output", type=non_negative_float, default=0.0, help="for the cost")
    add_engine_arguments(parser)
    add_prompt_arguments(parser)
    add_eval_subset_arguments(parser)
    add_search_r1_arguments(parser)
    return parser


def check_judge_flags(args: argparse.Namespace) -> None:
    if args.judge_url and not args.judge_model:
        raise ValueError("--judge-url needs --judge-model")


def judge_config(args: argparse.Namespace):
    from slime_search.evaluation.judge import JudgeConfig

    if args.judge_cache:
        cache = args.judge_cache
    elif args.output:
        cache = str(Path(args.output).with_suffix(".judge.sqlite"))
    else:
        cache = str(Path.home() / ".cache" / "slime-search" / "judge.sqlite")
    return JudgeConfig(
        args.judge_url,
        args.judge_model,
        cache,
        args.judge_api_key_env,
        args.judge_concurrency,
        usd_per_million_input=args.judge_usd_per_million_input,
        usd_per_million_output=args.judge_usd_per_million_output,
    )


def judge_items(samples: list) -> list:
    """(question, answer, references) of each sample for the judge; None where the reward found no answer."""
    from slime_search.evaluation.judge import question_of
    from slime_search.search_r1.reward import golden_answers_of

    items = []
    for sample in samples:
        answer = sample.reward.get("answer") if isinstance(sample.reward, dict) else None
        references = golden_answers_of(sample.label) if sample.label is not None else []
        items.append((question_of(sample.prompt), answer, references) if answer and references else None)
    return items


def check_engine_inputs(args: argparse.Namespace) -> None:
    """An evaluation that decodes needs a tokenizer folder and the sets to decode."""
    needed = {"--hf-checkpoint": args.hf_checkpoint, "--eval-prompt-data": args.eval_prompt_data}
    missing = [flag for flag, value in needed.items() if not value]
    if missing:
        raise ValueError(f"{' and '.join(missing)} needed (or --grade FILES, or --compare A B)")


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

    from slime_search.engines.deployment import start_engines
    from slime_search.evaluation.subsets import eval_subset
    from slime_search.plugins import Plugins
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import evaluation_samples, plugin_args_for, run_rollout
    from slime_search.run.config import engine_config, eval_sets, sampling_params

    sets = tuple((name, limited(path, args.max_samples, work)) for name, path in eval_sets(args))
    try:
        plugins = Plugins.load(args.custom_generate_function_path, args.custom_rm_path)
        engines = start_engines(engine_config(args, use_gpu=torch.cuda.is_available()), work)
        plugin_args = plugin_args_for(args, engines)

        def run(source, config, params):
            return run_rollout(plugins, plugin_args, source, config, params)

        try:
            data = DataConfig("", args.input_key, args.label_key)
            params = sampling_params(args, greedy=True)
            return evaluation_samples(sets, data, args.reward_key, run, params, eval_subset(args))
        finally:
            engines.stop()
    finally:
        if args.max_samples is not None:  # the paths are the copies limited() made, not the user's files
            for _, path in sets:
                Path(path).unlink(missing_ok=True)


def write_results(args: argparse.Namespace, samples: list) -> None:
    """Print the metrics and the table; with --output, write them, the samples and the graded rows beside it."""
    from slime_search.evaluation.grading import rows_from_samples
    from slime_search.evaluation.table import search_r1_table, table_markdown, write_rows
    from slime_search.rollout.eval_metrics import evaluate_samples

    metrics = evaluate_samples(samples, args.reward_key)
    for key in sorted(metrics):
        print(f"{key:40s} {metrics[key]:.4f}")
    rows = rows_from_samples(samples, args.reward_key)
    if args.judge_url:
        from slime_search.evaluation.judge import judge_rows

        config = judge_config(args)
        ledger = judge_rows(rows, judge_items(samples), config)
        metrics.update({f"eval/{key}": float(value) for key, value in ledger.as_dict(config).items()})
        print(
            f"judge {config.model}: {ledger.asked} asked, {ledger.cached} from the cache ({config.cache_path}), "
            f"{ledger.failed} failed, {ledger.input_tokens} + {ledger.output_tokens} tokens, ${ledger.usd(config):.4f}"
            + (f"; errors: {' | '.join(sorted(set(ledger.errors))[:3])}" if ledger.errors else "")
        )
    table = search_r1_table(rows, seed=args.interval_seed)
    markdown = table_markdown(table)
    print("\n" + markdown)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(metrics, indent=1))
        with open(out.with_suffix(".samples.jsonl"), "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample.to_dict(), default=str) + "\n")
        write_rows(out.with_suffix(".grades.jsonl"), rows)
        out.with_suffix(".table.json").write_text(json.dumps(table, indent=1))
        out.with_suffix(".table.md").write_text(markdown)


def graded_rows(path: str, args: argparse.Namespace) -> list[dict]:
    """The graded rows of a file: a .grades.jsonl as it is; samples or trajectories graded by the reward plugin."""
    from slime_search.evaluation.grading import read_samples, rows_from_samples
    from slime_search.evaluation.table import read_rows
    from slime_search.plugins import load_function

    rows = read_rows(path)
    if rows and all({"source", "key", "em"} <= set(row) for row in rows):
        return rows
    samples = read_samples(path, load_function(args.custom_rm_path), args, args.label_key)
    return rows_from_samples(samples, args.reward_key)


def grade_files(args: argparse.Namespace) -> int:
    """--grade: the files' samples graded as they stand (no engine), then the results as an evaluation writes them."""
    from slime_search.evaluation.grading import read_samples
    from slime_search.plugins import load_function

    reward = load_function(args.custom_rm_path)
    samples = [s for path in args.grade for s in read_samples(path, reward, args, args.label_key)]
    write_results(args, samples)
    return 0


def compare_files(args: argparse.Namespace) -> int:
    """--compare A B: A - B per set and on the average, paired on the questions both runs graded."""
    from slime_search.evaluation.table import compare_runs, comparison_markdown

    a_path, b_path = args.compare
    a_rows, b_rows = graded_rows(a_path, args), graded_rows(b_path, args)
    comparison = compare_runs(a_rows, b_rows, args.interval_seed, args.compare_metric)
    print(f"A: {a_path}\nB: {b_path}\n")
    print(comparison_markdown(comparison, args.compare_metric))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"a": a_path, "b": b_path, "metric": args.compare_metric, **comparison}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    import shutil

    from slime_search.arguments import check_engine_flags, check_or_exit, check_plugins, preflight
    from slime_search.plugins import load_function
    from slime_search.run.config import eval_sets

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grade or args.compare:  # no engine: the reward plugin alone must load
        check_or_exit(parser, args, check_judge_flags, lambda parsed: load_function(parsed.custom_rm_path))
        try:
            return grade_files(args) if args.grade else compare_files(args)
        except (ValueError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    # usage errors before anything starts
    check_or_exit(parser, args, check_engine_inputs, check_judge_flags, eval_sets, check_engine_flags, check_plugins)
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
    write_results(args, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
