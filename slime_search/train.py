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

from slime_search.health.remedy import lr_scale, remedied_schedule

logger = logging.getLogger(__name__)


def evaluate(config, manager, sink, run, version: int) -> dict:
    from slime_search.rollout.progress import wait_with_progress

    started = time.perf_counter()
    metrics, shown = wait_with_progress(manager, manager.evaluate.remote(config.log_rollout_examples), "eval")
    sink.log(version, {**metrics, "weight_version": version, "time/eval_s": time.perf_counter() - started})
    run.record_examples(version, "eval", shown)
    return metrics


def record_eval_beside(result, sink, run, guard, step: int):
    """An evaluation beside training, recorded under the version it evaluated whenever it arrives, and reviewed by
    the guard then; returns the rollback it calls for, if any."""
    record = {
        **result.metrics,
        **result.record,
        "weight_version": result.version,
        "eval/lag_steps": step - result.version,
    }
    sink.log(result.version, record)
    run.record_examples(result.version, "eval", result.shown)
    return first_rollback(report(guard.review_eval(result.version, result.metrics), run, guard))


def save(run, group, manager, steps_done: int, config, protect: tuple[int, ...] = ()) -> None:
    """The actor (model, optimizer, RNG) and the rollout state in one folder that is renamed into place when complete,
    the tracker file last: a run killed mid-save resumes from the previous complete checkpoint. With --save-hf, the
    weights as an HF folder too, streamed shard by shard. Then all but the newest --keep-checkpoints checkpoints (and
    their HF folders) are removed, except those of `protect` (the health guard's rollback target and its best
    evaluated checkpoint)."""
    import ray

    state = run.rollout_state_file(steps_done, ray.get(manager.state_dict.remote()))
    group.save(str(run.checkpoints), steps_done, state)
    if config.save_hf:
        sync = config.weight_sync
        out = str(run.hf_folder(steps_done))
        group.on_all_ranks("write_hf_streamed", sync.hf_checkpoint, out, sync.bucket_bytes)
        logger.info("HF checkpoint of step %d: %s", steps_done, out)
    run.prune_checkpoints(config.keep_checkpoints, protect)
    if config.save_hf:
        run.prune_hf_folders()


def restore(run, sink, group, manager, transport, colocation, done: int) -> None:
    """Actor, data position and engines as they were at the checkpoint of `done` steps; records of later steps are
    dropped (they are redone)."""
    import ray

    state = run.rollout_state(done)
    colocation.for_training()
    group.load(str(run.checkpoints), done)
    ray.get(manager.load_state_dict.remote(state))
    if transport is not None:
        colocation.for_weight_push()
        transport.push(str(done))
    sink.drop_from(done)
    run.drop_examples_from(done)


def resume(config, run, group, manager, transport, sink, colocation, guard) -> int:
    """Continue after the last complete checkpoint of this run folder, if any; returns the next step. The health
    guard replays the records kept, and a remedy of earlier rollbacks holds again."""
    done = run.latest_checkpoint()
    guard.rollbacks = run.rollback_count()
    run.record_resume(done or 0, guard.rollbacks)
    if guard.rollbacks:
        group.set_lr_scale(lr_scale(config.health.lr_factor, guard.rollbacks))
    if done is None:
        # A run killed before its first checkpoint starts again from step 0: its records would be duplicated.
        dropped = sink.drop_from(0) + run.drop_examples_from(0) + run.drop_events_from(0, guard.rollbacks)
        if dropped:
            logger.info("no checkpoint in %s: dropped %d records of an earlier attempt", run.path, dropped)
        if config.model.load and transport is not None:  # the engines started from the HF weights; give them --load's
            colocation.for_weight_push()
            transport.push("0")
        return 0
    restore(run, sink, group, manager, transport, colocation, done)
    run.drop_events_from(done, guard.rollbacks)
    guard.replay(sink.read(), guard.rollbacks)
    logger.info("resumed after step %d", done)
    return done


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


def shut_down(transport, manager, group, sink, evaluator=None) -> None:
    """Engines leave the weight-update group, then the managers stop them; the actor and the sink close last."""
    from slime_search.ray.placement import stop_rollout_manager

    if transport is not None:
        try:
            transport.close()
        except Exception as err:  # noqa: BLE001 - a failed run still stops its engines and actors
            logger.warning("closing the weight transport: %s", err)
    for rollout_side in (manager, evaluator):
        if rollout_side is not None:
            stop_rollout_manager(rollout_side)
    group.shutdown()
    sink.close()


def report(events, run, guard) -> list:
    """The guard's events: logged, recorded in RUN/health.jsonl; a stop ends the run here with its message."""
    from slime_search.health.guard import RunStopped

    for event in events:
        logger.warning("health %s (%s): %s", event.action, event.rule, event.message)
    run.record_events([event.record(guard.rollbacks) for event in events])
    stop = next((event for event in events if event.action == "stop"), None)
    if stop is not None:
        raise RunStopped(stop.message)
    return list(events)


def train_on(config, group, batch, step: int, guard, run) -> dict[str, float]:
    """The trainer's log-probs of the batch, its health signals (stop on a damaged actor), the optimizer steps."""
    from slime_search.health.signals import batch_signals, importance_signals
    from slime_search.ray.train_group import split_into_steps

    group.prepare(batch.samples)
    metrics = batch_signals(batch.samples, step, config.actor.loss.tis_cap)
    report(guard.check_batch(step, metrics), run, guard)
    metrics.update(group.optimize(batch.samples, config.steps_per_rollout, guard.skip_above()))
    if config.actor.loss.mis is not None:  # the optimizer steps' batches, as optimize splits the rollout
        parts = split_into_steps(batch.samples, config.steps_per_rollout)
        metrics.update(importance_signals(parts, config.actor.loss.mis, step))
    return metrics


def event_counts(events, guard) -> dict[str, float]:
    counts = {f"health/{action}s": float(sum(e.action == action for e in events)) for action in ("warn", "refuse")}
    return {**counts, "health/rollbacks": float(guard.rollbacks)}


def end_on_checkpoint(target: int, run, group, transport, colocation, rollouts) -> None:
    """A run the guard stops ends on a checkpoint from before the trouble (HealthGuard.stop_checkpoint): the later
    ones (and their HF copies) go, so a resume starts there; the actor loads it and the engines serve it (and the
    disk transport leaves its weights in RUN/weights). The records of the failed steps are kept: the report shows
    what happened."""
    rollouts.stop()
    run.rewind_checkpoints(target)
    run.prune_hf_folders()
    colocation.for_training()
    group.load(str(run.checkpoints), target)
    if transport is not None:
        colocation.for_weight_push()
        transport.push(str(target))


def end_on_best(run, group, transport, colocation, guard) -> None:
    """After the final evaluation: a run whose held-out metric declined late ends on its best evaluated checkpoint
    (HealthGuard.end_on_best). The actor loads it and the engines serve it (the disk transport leaves it in
    RUN/weights). The later checkpoints stay: the records and a resume with more rollouts continue from the last."""
    event = guard.end_on_best(run.checkpoint_steps())
    if event is None:
        return
    target = int(event.values["ended_on"])
    colocation.for_training()
    group.load(str(run.checkpoints), target)
    if transport is not None:
        colocation.for_weight_push()
        transport.push(str(target))
    report([event], run, guard)


def roll_back(event, config, run, sink, group, manager, transport, colocation, guard, rollouts, beside=None):
    """Back to the newest checkpoint that stayed healthy before the trouble began, with the remedy of one more
    rollback; returns the step to continue from and the new schedule. Stops the run when no rollback is left or no
    checkpoint qualifies. Evaluations beside training of the versions undone are dropped."""
    from slime_search.health.guard import Event
    from slime_search.rollout.schedule import create_schedule

    before = int(event.values.get("since", event.step))
    target = guard.healthy_checkpoint(run.checkpoint_steps(), before)
    if guard.rollbacks >= config.health.max_rollbacks:
        stop = f"{event.message}; no rollback left (--max-rollbacks {config.health.max_rollbacks})"
        values = dict(event.values)
        # what the run leaves behind is a state from before the trouble, not the failing step's
        ending = guard.stop_checkpoint(run.checkpoint_steps(), before)
        if ending is not None:
            end_on_checkpoint(ending, run, group, transport, colocation, rollouts)
            why = "the last that stayed healthy" if ending == target else "the best evaluated before the trouble"
            stop += f"; the run ends on the checkpoint of step {ending}, {why}"
            values["ended_on"] = float(ending)
        report([Event(event.step, "stop", event.rule, stop, values)], run, guard)
    if target is None:
        stop = (
            f"{event.message}; no checkpoint at or before step {before} stayed healthy for "
            f"--health-confirm-steps {config.health.confirm_steps} steps to roll back to (see --save-interval)"
        )
        report([Event(event.step, "stop", event.rule, stop, event.values)], run, guard)
    rollouts.stop()
    run.rewind_checkpoints(target)
    run.prune_hf_folders()  # the HF copies of the checkpoints dropped go with them
    guard.rolled_back(target)
    schedule = remedied_schedule(config.schedule, guard.rollbacks)
    scale = lr_scale(config.health.lr_factor, guard.rollbacks)
    message = f"back to the checkpoint of step {target} ({event.rule} at step {event.step}); lr x{scale:g}"
    if schedule.mode != "off":
        message += f", --async-mode {schedule.mode} (max staleness {schedule.staleness})"
    values = {"to_step": float(target), "lr_scale": scale, "max_staleness": float(schedule.staleness)}
    report([Event(event.step, "rollback", event.rule, message, values)], run, guard)
    restore(run, sink, group, manager, transport, colocation, target)
    group.set_lr_scale(scale)
    rollouts = create_schedule(schedule, manager)
    rollouts.start(target)
    if beside is not None:
        beside.rolled_back(target)
    return target, rollouts


def run_steps(config, start: int, run, sink, group, manager, transport, colocation, guard, beside=None) -> None:
    """Steps `start`.. of the run: rollout (as --async-mode schedules it) -> health checks -> GRPO step -> weight push
    -> records -> the guard's review (a rollback goes back to a healthy checkpoint); eval every --eval-interval
    versions (inside the step, or `beside` it on an engine of its own: EvalBeside), checkpoints every
    --save-interval steps, the final eval."""
    import ray

    from slime_search.metrics import PhaseClock
    from slime_search.rollout.schedule import create_schedule

    if start == 0 and config.health.enabled and config.save_interval and run.latest_checkpoint() is None:
        # the weights the run starts from: the rollback target of a run that goes wrong before a later checkpoint
        # could prove healthy (at lr 1e-2 the miniature broke at its first update)
        colocation.for_weight_push()
        save(run, group, manager, 0, config)
        if config.colocate and transport is not None:  # colocated engines gave their weights up for the save
            transport.push("0")
    rollouts = create_schedule(remedied_schedule(config.schedule, guard.rollbacks), manager)
    rollouts.start(start)
    step = start
    while True:
        if step == config.num_rollout:
            rollouts.stop()  # what is in flight is cancelled: the final evaluation runs alone
        colocation.for_generation()
        handover_s = 0.0
        if config.eval_due(step) and beside is not None:
            colocation.for_weight_push()  # the actor's weights must be on its device to be written
            handover_s = beside.submit(step)
            colocation.for_generation()
        rollback = None
        if beside is not None:  # the results that arrived; at the end, all of them
            for result in beside.collect(wait=step >= config.num_rollout):
                rollback = record_eval_beside(result, sink, run, guard, step)
                if rollback is not None:
                    break  # the results after it are of later versions, which the rollback undoes
        elif config.eval_due(step):
            metrics = evaluate(config, manager, sink, run, step)
            rollback = first_rollback(report(guard.review_eval(step, metrics), run, guard))
        if rollback is not None:
            step, rollouts = roll_back(
                rollback, config, run, sink, group, manager, transport, colocation, guard, rollouts, beside
            )
            continue
        if step >= config.num_rollout:
            end_on_best(run, group, transport, colocation, guard)
            return
        clock = PhaseClock()
        batch = rollouts.next_batch(step, config.log_rollout_examples)
        run.record_examples(step, "train", batch.examples)
        metrics = batch.metrics
        clock.mark("rollout")
        restarted = restart_down_engines(config, manager)
        metrics["engines/restarted"] = float(len(restarted))
        clock.mark("engine_check")
        colocation.for_training()
        events = report(guard.check_rollout(step, metrics, batch.errors), run, guard)
        metrics["health/step_skipped"] = float(any(e.action == "skip" for e in events))
        if not metrics["health/step_skipped"]:
            metrics.update(train_on(config, group, batch, step, guard, run))
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
        metrics.update({**colocation.metrics(), **clock.times(), **trainer_idle(clock)})
        if beside is not None:
            metrics["time/eval_handover_s"] = handover_s  # the actor writing the weights the eval engine loads
        reviewed = guard.review(step, metrics)
        events += reviewed
        sink.log(step, {**metrics, **event_counts(events, guard)})  # the step's record, also when the run stops here
        report(reviewed, run, guard)
        rollback = first_rollback(events)
        if rollback is not None:
            step, rollouts = roll_back(
                rollback, config, run, sink, group, manager, transport, colocation, guard, rollouts, beside
            )
            continue
        if config.save_due(step + 1):
            colocation.for_weight_push()  # the actor's state must be on its device
            kept = run.checkpoint_steps()
            protect = (guard.protected_checkpoint(kept), guard.protected_best(kept))
            save(run, group, manager, step + 1, config, tuple(k for k in protect if k is not None))
        step += 1


def first_rollback(events):
    return next((event for event in events if event.action == "rollback"), None)


def answer_sigint() -> None:
    """Stop on SIGINT however the driver was launched. A job started in the background by a non-interactive shell
    (`python -m slime_search.train ... &` in a script) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: `kill -INT` would be lost and the run, Ray and the engines would go on."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args, preflight

    answer_sigint()

    args = parse_args(argv)
    preflight(args)  # a retriever that is down is found now, not after Ray started and the models loaded
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import ray
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import check_model_flags
    from slime_search.eval_beside import EvalBeside
    from slime_search.health.guard import HealthGuard, RunStopped
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.ray.placement import create_eval_manager, create_rollout_manager
    from slime_search.ray.session import RECORD_NAME, record_started_processes
    from slime_search.ray.train_group import RayTrainGroup
    from slime_search.report import render_report
    from slime_search.run_config import run_config
    from slime_search.run_folder import RunFolder
    from slime_search.weight_sync.transports import create_transport

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    check_model_flags(args, hf_config)
    config = run_config(args, hf_config.vocab_size, use_gpu=torch.cuda.is_available())
    run = RunFolder(config.run_dir)
    run.record_health_config(config.health)
    sink = MetricsSink(run.path, *config.wandb, config=vars(args))
    if not ray.is_initialized():
        # the actors' warnings reach this console: each actor logs WARNING and above to its stderr, which Ray forwards
        ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
    process_record = run.path / RECORD_NAME  # what a SIGKILLed driver leaves, for the run scripts to stop
    record_started_processes(process_record)
    group = RayTrainGroup(config.train_group)
    manager = transport = evaluator = beside = None
    try:
        if not config.colocate:  # the engines start while the actor loads
            manager = create_rollout_manager(config.rollout, args, group, colocate=False)
        if config.eval_engine is not None:  # --eval-engine: evaluation beside training, on an engine of its own
            evaluator = create_eval_manager(config.eval_engine, args, group)
            beside = EvalBeside(evaluator, group, run.path, config.weight_sync, config.log_rollout_examples)
        group.load_models(config.model, config.actor)
        colocation = Colocation(config.colocate, group, manager)
        if config.colocate:  # the engines start on the actor's GPUs once the actor has made room
            colocation.for_generation()
            manager = colocation.manager = create_rollout_manager(config.rollout, args, group, colocate=True)
        if config.serves_policy:  # in SFT the samples come from another engine, which takes no weights
            transport = create_transport(config.weight_sync, group, ray.get(manager.worker_urls.remote()))
            transport.connect()
        guard = HealthGuard(config.health, config.rollout.rollout.reward_key)
        start = resume(config, run, group, manager, transport, sink, colocation, guard)
        record_started_processes(process_record)  # the engines, the actor's workers and Ray's agents are up now
        run_steps(config, start, run, sink, group, manager, transport, colocation, guard, beside)
    except RunStopped as stopped:  # the guard's verdict: the run cannot go on; the report says why as well
        logger.error("run stopped: %s", stopped)
        logger.info("report: %s", render_report(run.path))
        return 1
    finally:
        shut_down(transport, manager, group, sink, evaluator)
    logger.info("report: %s", render_report(run.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
