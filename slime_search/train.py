"""The training driver: per step, rollout -> GRPO advantages -> Megatron step -> weight sync; eval between steps.

    python -m slime_search.train --hf-checkpoint CKPT --save RUN --prompt-data train.parquet \
        --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 --search-url http://127.0.0.1:8000/retrieve

Megatron ranks run as Ray actors placed by a placement group (CPU bundles on a CPU machine); the RolloutManager
Ray actor owns the engines (the CPU engine server, or SGLang engines behind the router on GPU), the prompt data and
the generate / reward plugins. Weights reach the engines by broadcast from actor rank 0 (NCCL; gloo on CPU), by
tensor handles (CUDA IPC; shared memory on CPU) or through an HF checkpoint on disk (--update-weight-transport).
With --colocate the engines share the actor's devices and the two hand memory over between phases
(slime_search.colocation). Running the same command again continues from the run folder's last complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def wait_with_progress(manager, ref, desc: str):
    """Wait for a RolloutManager call, drawing a progress bar over its samples (only on a terminal)."""
    import ray
    from tqdm import tqdm

    with tqdm(desc=desc, unit="sample", disable=None, leave=False) as bar:
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            bar.n, bar.total = ray.get(manager.progress.remote())
            bar.refresh()
            if ready:
                return ray.get(ref)


def train_on(args, group, samples) -> dict[str, float]:
    """Old (and reference) log-probs for the whole rollout, then `steps_per_rollout` optimizer steps."""
    from slime_search.arguments import steps_per_rollout
    from slime_search.rollout.rollout import split_for_data_parallel

    dp_size = group.config.dp_size
    shards = split_for_data_parallel(samples, dp_size)
    for shard, log_probs in zip(shards, group.compute_log_probs(shards), strict=True):
        for sample, values in zip(shard, log_probs, strict=True):
            sample.old_log_probs = values
    if args.use_kl_loss:
        for shard, log_probs in zip(shards, group.compute_ref_log_probs(shards), strict=True):
            for sample, values in zip(shard, log_probs, strict=True):
                sample.ref_log_probs = values
    steps = steps_per_rollout(args)
    per_step = len(samples) // steps
    metrics: dict[str, float] = {}
    for k in range(steps):
        chunk = split_for_data_parallel(samples[k * per_step : (k + 1) * per_step], dp_size)
        for name, value in group.train_step(chunk).items():
            metrics[f"train/{name}"] = metrics.get(f"train/{name}", 0.0) + value / steps
    return metrics


def sync_weights(args, group, manager, run: Path, version: int) -> str:
    """Push the actor's weights to every engine (see slime_search.weight_sync); every engine must then serve
    `version`. A disk sync keeps only the newest checkpoint copy."""
    from slime_search.weight_sync import push_weights

    served = push_weights(args, group, manager, run / "weights" / f"step_{version}", str(version))
    for older in (run / "weights").glob("step_*"):
        if older.name != f"step_{version}":
            shutil.rmtree(older, ignore_errors=True)
    return served


def evaluate(args, manager, sink, run: Path, version: int) -> None:
    started = time.perf_counter()
    metrics, shown = wait_with_progress(manager, manager.evaluate.remote(args.log_rollout_examples), "eval")
    sink.log(version, {**metrics, "weight_version": version, "time/eval_s": time.perf_counter() - started})
    record_examples(run, version, "eval", shown)


def record_examples(run: Path, step: int, kind: str, examples: list[dict]) -> None:
    with open(run / "rollouts.jsonl", "a") as handle:
        for example in examples:
            handle.write(json.dumps({"step": step, "kind": kind, **example}) + "\n")


def save_run(run: Path, group, manager, steps_done: int) -> None:
    """Rollout state first, then the actor (model, optimizer, RNG), whose tracker file is written last: a run
    killed mid-save resumes from the previous complete checkpoint."""
    import ray

    from slime_search.backends.megatron.checkpoint import iteration_dir

    folder = iteration_dir(run / "checkpoints", steps_done)
    folder.mkdir(parents=True, exist_ok=True)
    state = {"steps_done": steps_done, **ray.get(manager.state_dict.remote())}
    (folder / "rollout_state.json").write_text(json.dumps(state))
    group.save(str(run / "checkpoints"), steps_done)


def resume(args, run: Path, group, manager, sink, colocation) -> int:
    """Continue after the last complete checkpoint of this run folder, if any; returns the next step."""
    import ray

    from slime_search.backends.megatron.checkpoint import iteration_dir, latest_iteration

    done = latest_iteration(run / "checkpoints")
    if done is None:
        if args.load and serves_policy(args):  # the engines started from the HF weights; give them --load's
            colocation.for_weight_push()
            sync_weights(args, group, manager, run, 0)
        return 0
    state = json.loads((iteration_dir(run / "checkpoints", done) / "rollout_state.json").read_text())
    colocation.for_training()
    group.load(str(run / "checkpoints"))
    ray.get(manager.load_state_dict.remote(state))
    if serves_policy(args):
        colocation.for_weight_push()
        sync_weights(args, group, manager, run, done)
    sink.drop_from(done)  # steps after the checkpoint are redone
    drop_examples_from(run, done)
    logger.info("resumed after step %d", done)
    return int(state["steps_done"])


def drop_examples_from(run: Path, step: int) -> None:
    path = run / "rollouts.jsonl"
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in kept))


def serves_policy(args) -> bool:
    """Whether the engine generates with the policy being trained. In SFT the samples come from elsewhere (a
    demonstrator behind --engine-url), so no weights are pushed to it."""
    return args.loss_type != "sft"


def eval_due(args, version: int) -> bool:
    if not args.eval_prompt_data or not serves_policy(args):
        return False
    return version == args.num_rollout or bool(args.eval_interval and version % args.eval_interval == 0)


def write_report(run: Path) -> None:
    from slime_search.report import render_report

    logger.info("report: %s", render_report(run))


def disconnect_engines(group) -> None:
    try:
        group.disconnect_engines()
    except Exception as err:  # noqa: BLE001 - a failed run still stops its engines and actors
        logger.warning("leaving the weight-update group: %s", err)


def stop(manager) -> None:
    """Stop the engines the manager started, then the actor itself (also when its start-up failed)."""
    import ray

    try:
        ray.get(manager.shutdown.remote(), timeout=60)
    except Exception as err:  # noqa: BLE001 - a manager that failed to start has nothing to stop
        logger.warning("rollout manager shutdown: %s", err)
    ray.kill(manager)


def start_rollout_manager(args, group):
    """The RolloutManager actor, which starts the engines: on GPUs of their own (Ray gives them to the manager
    and keeps them apart from the actor's), on the actor's GPUs with --colocate, or the CPU engine."""
    import ray
    import torch

    from slime_search.ray.rollout_manager import RolloutManager

    on_gpu = torch.cuda.is_available()
    if args.colocate and on_gpu:
        args.rollout_num_gpus = group.config.num_ranks  # one engine GPU per actor GPU
    rollout_gpus = args.rollout_num_gpus if on_gpu and not args.colocate else 0
    gpu_ids = group.gpu_ids() if on_gpu and args.colocate else None
    options = {"num_cpus": 0, "num_gpus": rollout_gpus, "max_concurrency": 2}
    return ray.remote(RolloutManager).options(**options).remote(args, gpu_ids)


def load_actor(args, group, vocab_size: int) -> None:
    from slime_search.arguments import actor_config, model_overrides

    config, overrides = actor_config(args, vocab_size), model_overrides(args)
    group.load_hf(args.hf_checkpoint, config, args.load, overrides)
    if args.use_kl_loss:
        group.load_reference(args.hf_checkpoint, config, args.ref_load or args.load, overrides)


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import ray
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import check_model_flags
    from slime_search.colocation import Colocation
    from slime_search.metrics import MetricsSink, PhaseClock
    from slime_search.ray.train_group import RayTrainGroup, TrainGroupConfig
    from slime_search.weight_sync import connect_engines

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    check_model_flags(args, hf_config)
    run = Path(args.save)
    sink = MetricsSink(
        run, use_wandb=args.use_wandb, project=args.wandb_project, group=args.wandb_group, config=vars(args)
    )
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    group = RayTrainGroup(TrainGroupConfig(ranks, args.tensor_model_parallel_size, use_gpu=torch.cuda.is_available()))
    manager = None
    try:
        if not args.colocate:  # the engines start while the actor loads
            manager = start_rollout_manager(args, group)
        load_actor(args, group, hf_config.vocab_size)
        colocation = Colocation(args.colocate, group, manager)
        if args.colocate:  # the engines start on the actor's GPUs once the actor has made room
            colocation.for_generation()
            manager = colocation.manager = start_rollout_manager(args, group)
        if serves_policy(args):
            connect_engines(args, group, manager)
        start = resume(args, run, group, manager, sink, colocation)
        for step in range(start, args.num_rollout):
            colocation.for_generation()
            if eval_due(args, step):
                evaluate(args, manager, sink, run, step)
            clock = PhaseClock()
            samples, metrics, shown = wait_with_progress(
                manager, manager.generate.remote(args.log_rollout_examples), f"rollout {step}"
            )
            record_examples(run, step, "train", shown)
            clock.mark("rollout")
            colocation.for_training()
            metrics.update(train_on(args, group, samples))
            clock.mark("train")
            if serves_policy(args):
                colocation.for_weight_push()
                metrics["weight_version"] = int(sync_weights(args, group, manager, run, step + 1))
                clock.mark("sync")
            sink.log(step, {**metrics, **colocation.metrics(), **clock.times()})
            if (args.save_interval and (step + 1) % args.save_interval == 0) or step + 1 == args.num_rollout:
                colocation.for_weight_push()  # the actor's state must be on its device
                save_run(run, group, manager, step + 1)
        if eval_due(args, args.num_rollout) and start <= args.num_rollout:
            colocation.for_generation()
            evaluate(args, manager, sink, run, args.num_rollout)
        write_report(run)
    finally:
        disconnect_engines(group)
        if manager is not None:
            stop(manager)
        group.shutdown()
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
