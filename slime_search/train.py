"""The training driver: rollout -> advantages -> Megatron step -> weight sync -> eval, once per step.

    python -m slime_search.train --hf-checkpoint CKPT --save RUN --prompt-data train.parquet \
        --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 --search-url http://127.0.0.1:8000/retrieve

Megatron ranks run as Ray actors (CPU bundles on a CPU machine); the rollout engine is the CPU engine server
here (SGLang engines behind the router on GPU); the retriever is reached over HTTP at --search-url.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path


def to_train_sample(sample):
    from slime_search.backends.megatron.loss import TrainSample

    return TrainSample(
        tokens=list(sample.tokens),
        response_length=sample.response_length,
        loss_mask=list(sample.loss_mask),
        advantage=float(sample.metadata.get("advantage", 0.0)),
        rollout_log_probs=list(sample.rollout_log_probs),
    )


async def rollout(args, source, config, generate, reward, params):
    from slime_search.rollout.rollout import generate_rollout
    from slime_search.search_r1.generate import close_resources

    try:
        return await generate_rollout(args, source, config, generate, reward, params)
    finally:
        await close_resources()


def evaluate(args, generate, reward) -> dict[str, float]:
    from slime_search.arguments import rollout_config, sampling_params
    from slime_search.evaluation import evaluate_samples
    from slime_search.rollout.data_source import DataConfig, DataSource

    samples = []
    for name, path in zip(args.eval_prompt_data[::2], args.eval_prompt_data[1::2], strict=True):
        source = DataSource(DataConfig(path, args.input_key, args.label_key))
        config = rollout_config(args)
        config = type(config)(batch_size=len(source), n_samples_per_prompt=1, reward_key=config.reward_key)
        groups, _ = asyncio.run(rollout(args, source, config, generate, reward, sampling_params(args, greedy=True)))
        for group in groups:
            for sample in group:
                sample.metadata["data_source"] = sample.metadata.get("data_source") or name
                samples.append(sample)
    return evaluate_samples(samples)


def save_run(run: Path, group, source, steps_done: int) -> None:
    """Rollout position first, then the actor (model + optimizer), whose tracker file is written last: a run
    killed mid-save resumes from the previous complete checkpoint."""
    import json

    from slime_search.backends.megatron.checkpoint import iteration_dir

    folder = iteration_dir(run / "checkpoints", steps_done)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rollout_state.json").write_text(json.dumps({"steps_done": steps_done, "data": source.state_dict()}))
    group.save(str(run / "checkpoints"), steps_done)


def resume(args, run: Path, group, source, engine_url: str) -> int:
    """Continue from the last complete checkpoint of this run folder, if any; returns the next step."""
    import json

    from slime_search.backends.megatron.checkpoint import iteration_dir, latest_iteration
    from slime_search.weight_sync import update_engines_from_disk

    done = latest_iteration(run / "checkpoints")
    if done is None:
        return 0
    state = json.loads((iteration_dir(run / "checkpoints", done) / "rollout_state.json").read_text())
    group.load(str(run / "checkpoints"))
    source.load_state_dict(state["data"])
    weights = group.write_hf(args.hf_checkpoint, str(run / "weights" / f"step_{done}"))
    asyncio.run(update_engines_from_disk([engine_url], weights, str(done)))
    logging.getLogger(__name__).info("resumed after step %d", done)
    return int(state["steps_done"])


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import ray
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import actor_config, rollout_config, sampling_params
    from slime_search.metrics import MetricsSink
    from slime_search.plugins import load_function
    from slime_search.ray.train_group import RayTrainGroup, TrainGroupConfig
    from slime_search.rollout.data_source import DataConfig, DataSource
    from slime_search.rollout.rollout import assign_advantages, split_for_data_parallel
    from slime_search.utils.server_process import ServerProcess
    from slime_search.weight_sync import update_engines_from_disk

    if args.rollout_num_engines != 1:
        raise SystemExit("the CPU driver runs one rollout engine: --rollout-num-engines 1")
    run = Path(args.save)
    sink = MetricsSink(run, use_wandb=args.use_wandb, config=vars(args))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    vocab_size = AutoConfig.from_pretrained(args.hf_checkpoint).vocab_size
    ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    group = RayTrainGroup(TrainGroupConfig(ranks, args.tensor_model_parallel_size, use_gpu=torch.cuda.is_available()))
    engine_argv = ["-m", "slime_search.rollout.cpu_engine_server", "--model-path", args.hf_checkpoint, "--port", "0"]
    engine = ServerProcess(
        [*engine_argv, "--max-batch-size", str(args.engine_max_batch_size)], log_path=run / "engine.log"
    )
    try:
        group.load_hf(args.hf_checkpoint, actor_config(args, vocab_size))
        args.engine_url = engine.url
        generate = load_function(args.custom_generate_function_path)
        reward = load_function(args.custom_rm_path)
        data = DataConfig(
            args.prompt_data, args.input_key, args.label_key, shuffle=args.rollout_shuffle, seed=args.rollout_seed
        )
        source = DataSource(data)
        dp_size = group.config.dp_size
        start_step = resume(args, run, group, source, engine.url)
        for step in range(start_step, args.num_rollout):
            times = {"start": time.perf_counter()}
            groups, metrics = asyncio.run(
                rollout(args, source, rollout_config(args), generate, reward, sampling_params(args))
            )
            times["rollout"] = time.perf_counter()
            samples = assign_advantages(
                [s for g in groups for s in g], args.reward_key, args.advantage_estimator == "grpo"
            )
            shards = split_for_data_parallel([to_train_sample(s) for s in samples], dp_size)
            for shard, log_probs in zip(shards, group.compute_log_probs(shards), strict=True):
                for sample, lp in zip(shard, log_probs, strict=True):
                    sample.old_log_probs = lp
            metrics.update({f"train/{k}": v for k, v in group.train_step(shards).items()})
            times["train"] = time.perf_counter()
            weights = group.write_hf(args.hf_checkpoint, str(run / "weights" / f"step_{step + 1}"))
            asyncio.run(update_engines_from_disk([engine.url], weights, str(step + 1)))
            times["sync"] = time.perf_counter()
            if args.eval_prompt_data and args.eval_interval and (step + 1) % args.eval_interval == 0:
                metrics.update(evaluate(args, generate, reward))
            times["eval"] = time.perf_counter()
            for phase, before in (("rollout", "start"), ("train", "rollout"), ("sync", "train"), ("eval", "sync")):
                metrics[f"time/{phase}_s"] = times[phase] - times[before]
            metrics["time/step_s"] = times["eval"] - times["start"]
            metrics["weight_version"] = step + 1
            sink.log(step, metrics)
            if (args.save_interval and (step + 1) % args.save_interval == 0) or step + 1 == args.num_rollout:
                save_run(run, group, source, step + 1)
    finally:
        engine.stop()
        group.shutdown()
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
