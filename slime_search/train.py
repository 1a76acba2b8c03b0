"""The training driver: per step, rollout -> GRPO advantages -> Megatron step -> weight sync; eval between steps.

    python -m slime_search.train --hf-checkpoint CKPT --save RUN --prompt-data train.parquet \
        --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 --search-url http://127.0.0.1:8000/retrieve

Megatron ranks run as Ray actors placed by a placement group (CPU bundles on a CPU machine; slime_search.ray); the
RolloutManager Ray actor owns the engines (the CPU engine server, or SGLang engines behind the router on GPU), the
prompt data and the generate / reward plugins (slime_search.rollout). Weights reach the engines by one transport
(slime_search.weight_sync: broadcast from actor rank 0, tensor handles, or an HF checkpoint on disk). With
--colocate the engines share the actor's devices and the two hand memory over between phases
(slime_search.ray.colocation). Running the same command again continues from the run folder's last complete
checkpoint.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)


def evaluate(config, manager, sink, run, version: int) -> None:
    from slime_search.ray.placement import wait_with_progress

    started = time.perf_counter()
    metrics, shown = wait_with_progress(manager, manager.evaluate.remote(config.log_rollout_examples), "eval")
    sink.log(version, {**metrics, "weight_version": version, "time/eval_s": time.perf_counter() - started})
    run.record_examples(version, "eval", shown)


def save(run, group, manager, steps_done: int, keep: int) -> None:
    """The actor (model, optimizer, RNG) and the rollout state in one folder that is renamed into place when complete,
    the tracker file last: a run killed mid-save resumes from the previous complete checkpoint. Then all but the
    newest `keep` checkpoints are removed."""
    import ray

    state = run.rollout_state_file(steps_done, ray.get(manager.state_dict.remote()))
    group.save(str(run.checkpoints), steps_done, state)
    run.prune_checkpoints(keep)


def resume(config, run, group, manager, transport, sink, colocation) -> int:
    """Continue after the last complete checkpoint of this run folder, if any; returns the next step."""
    import ray

    done = run.latest_checkpoint()
    if done is None:
        # A run killed before its first checkpoint starts again from step 0: its records would be duplicated.
        dropped = sink.drop_from(0) + run.drop_examples_from(0)
        if dropped:
            logger.info("no checkpoint in %s: dropped %d records of an earlier attempt", run.path, dropped)
        if config.model.load and transport is not None:  # the engines started from the HF weights; give them --load's
            colocation.for_weight_push()
            transport.push("0")
        return 0
    state = run.rollout_state(done)
    colocation.for_training()
    group.load(str(run.checkpoints))
    ray.get(manager.load_state_dict.remote(state))
    if transport is not None:
        colocation.for_weight_push()
        transport.push(str(done))
    sink.drop_from(done)  # steps after the checkpoint are redone
    run.drop_examples_from(done)
    logger.info("resumed after step %d", done)
    return int(state["steps_done"])


def restart_down_engines(config, manager) -> list[str]:
    """After a rollout: engines that died or stopped answering start again, while the actor trains. Colocated engines
    are not restarted (one would take GPU memory the actor holds): the next push to a dead one fails the run, which
    then resumes from its last checkpoint."""
    import ray

    if config.colocate:
        return []
    return ray.get(manager.restart_down_engines.remote())


def engines_back(manager, transport) -> list[str]:
    """Before the push: wait for the restarted engines and pause them, so that no trajectory reaches one before it
    holds the current weights (a stream of groups keeps its clients, which retry an engine marked down after a
    while); they take the push with the others and continue after it."""
    import ray

    back = ray.get(manager.wait_restarted_engines.remote())
    if back:
        ray.get(manager.pause_generation.remote(back))
        if transport is not None:
            transport.reconnect()
        logger.warning("engines %s are back; they take the next weight push", back)
    return back


def trainer_idle(clock) -> dict[str, float]:
    """The share of the step the actor neither trained nor pushed weights: it waited for its batch (or engines)."""
    times = clock.times()
    busy = times.get("time/train_s", 0.0) + times.get("time/sync_s", 0.0)
    return {"async/trainer_idle_fraction": 1.0 - busy / times["time/step_s"] if times["time/step_s"] > 0 else 0.0}


def shut_down(transport, manager, group, sink) -> None:
    """Engines leave the weight-update group, then the manager stops them; the actor and the sink close last."""
    from slime_search.ray.placement import stop_rollout_manager

    if transport is not None:
        try:
            transport.close()
        except Exception as err:  # noqa: BLE001 - a failed run still stops its engines and actors
            logger.warning("closing the weight transport: %s", err)
    if manager is not None:
        stop_rollout_manager(manager)
    group.shutdown()
    sink.close()


def run_steps(config, start: int, run, sink, group, manager, transport, colocation) -> None:
    """Steps `start`.. of the run: rollout (as --async-mode schedules it) -> GRPO step -> weight push -> records;
    eval every --eval-interval versions and checkpoints every --save-interval steps; the final eval."""
    import ray

    from slime_search.metrics import PhaseClock
    from slime_search.rollout.schedule import create_schedule

    rollouts = create_schedule(config.schedule, manager)
    rollouts.start(start)
    for step in range(start, config.num_rollout):
        colocation.for_generation()
        if config.eval_due(step):
            evaluate(config, manager, sink, run, step)
        clock = PhaseClock()
        samples, metrics, shown = rollouts.next_batch(step, config.log_rollout_examples)
        run.record_examples(step, "train", shown)
        clock.mark("rollout")
        restarted = restart_down_engines(config, manager)
        metrics["engines/restarted"] = float(len(restarted))
        clock.mark("engine_check")
        colocation.for_training()
        metrics.update(group.train(samples, config.steps_per_rollout))
        clock.mark("train")
        back = engines_back(manager, transport) if restarted else []
        clock.mark("engine_restart_wait")
        with rollouts.weight_push():  # one-step: the stream drains first; fully: the engines pause meanwhile
            clock.mark("drain")
            if transport is not None:
                colocation.for_weight_push()
                metrics["weight_version"] = int(transport.push(str(step + 1)))
        if back:
            ray.get(manager.continue_generation.remote(back))
        rollouts.pushed(step + 1)
        clock.mark("sync")
        sink.log(step, {**metrics, **colocation.metrics(), **clock.times(), **trainer_idle(clock)})
        if config.save_due(step + 1):
            colocation.for_weight_push()  # the actor's state must be on its device
            save(run, group, manager, step + 1, config.keep_checkpoints)
    rollouts.stop()
    if config.eval_due(config.num_rollout) and start <= config.num_rollout:
        colocation.for_generation()
        evaluate(config, manager, sink, run, config.num_rollout)


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import ray
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import check_model_flags, run_config
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.ray.placement import create_rollout_manager
    from slime_search.ray.train_group import RayTrainGroup
    from slime_search.report import render_report
    from slime_search.run_folder import RunFolder
    from slime_search.weight_sync.transports import create_transport

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    check_model_flags(args, hf_config)
    config = run_config(args, hf_config.vocab_size, use_gpu=torch.cuda.is_available())
    run = RunFolder(config.run_dir)
    sink = MetricsSink(run.path, *config.wandb, config=vars(args))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    group = RayTrainGroup(config.train_group)
    manager = transport = None
    try:
        if not config.colocate:  # the engines start while the actor loads
            manager = create_rollout_manager(config.rollout, args, group, colocate=False)
        group.load_models(config.model, config.actor)
        colocation = Colocation(config.colocate, group, manager)
        if config.colocate:  # the engines start on the actor's GPUs once the actor has made room
            colocation.for_generation()
            manager = colocation.manager = create_rollout_manager(config.rollout, args, group, colocate=True)
        if config.serves_policy:  # in SFT the samples come from another engine, which takes no weights
            transport = create_transport(config.weight_sync, group, ray.get(manager.worker_urls.remote()))
            transport.connect()
        start = resume(config, run, group, manager, transport, sink, colocation)
        run_steps(config, start, run, sink, group, manager, transport, colocation)
        logger.info("report: %s", render_report(run.path))
    finally:
        shut_down(transport, manager, group, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
