"""The training driver: per step, rollout -> GRPO advantages -> Megatron step -> weight sync; eval between steps.

    python -m slime_search.train --hf-checkpoint CKPT --save RUN --prompt-data train.parquet \
        --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 --search-url http://127.0.0.1:8000/retrieve

Megatron ranks run as Ray actors placed by a placement group (CPU bundles on a CPU machine; slime_search.ray); the
RolloutManager Ray actor owns the engines (the CPU engine server, or SGLang engines behind the router on GPU), the
prompt data and the generate / reward plugins (slime_search.rollout). Weights reach the engines by one transport
(slime_search.weight_sync: broadcast from actor rank 0, tensor handles, or an HF checkpoint on disk). With
--colocate the engines share the actor's devices and the two hand memory over between phases
(slime_search.ray.colocation). The health guard checks every step (slime_search.health); what it decides is carried
out by slime_search.health.recovery. Running the same command again continues from the run folder's last complete
checkpoint; exit code 3 means the guard stopped the run (RUN/stopped.json says what to change).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def run_steps(h, recovery, start: int) -> None:
    """Steps `start`.. of the run: held-out evaluations that are due (inside the step or beside it), then rollout ->
    health checks -> GRPO step -> weight push -> the guard's review; a rollback goes back to a healthy checkpoint.
    Checkpoints every --save-interval steps (a full --save disk is waited out); at the end the final evaluation, and
    the weights the run ends on."""
    from slime_search.health.pauses import save_checkpoint

    if start == 0 and h.config.health.enabled and h.config.save_interval and h.run.latest_checkpoint() is None:
        # the weights the run starts from: the rollback target before a later checkpoint proves healthy
        save_checkpoint(h, recovery, 0)
    h.start_rollouts(start)
    step = start
    while True:
        if step == h.config.num_rollout:
            h.rollouts.stop()  # what is in flight is cancelled: the final evaluation runs alone
        rollback = evaluate(h, recovery, step)
        if rollback is None and step < h.config.num_rollout:
            rollback = train_step(h, recovery, step)
        if rollback is not None:
            step = recovery.roll_back(rollback)
            continue
        if step >= h.config.num_rollout:
            recovery.end(step)
            return
        if h.config.save_due(step + 1):
            save_checkpoint(h, recovery, step + 1)
        step += 1
        recovery.follow_remedy(step)


def evaluate(h, recovery, step: int):
    """The evaluations with a result now, recorded under the versions they evaluated and reviewed by the guard;
    returns the first rollback one calls for (results after it are of versions the rollback undoes)."""
    h.colocation.for_generation()
    for result in h.evaluator.results(step):
        rollback = recovery.record_eval(result, step)
        if rollback is not None:
            return rollback
    return None


def train_step(h, recovery, step: int):
    """One step: its batch (a rollout that a passing fault broke is done again after a wait: health.pauses), the checks
    before training, the update, the weight push, the step's record and the guard's review of it; returns the rollback
    the guard calls for, if any."""
    import ray

    from slime_search.health.pauses import usable_rollout
    from slime_search.health.recovery import event_counts, first_rollback
    from slime_search.metrics import PhaseClock, trainer_idle

    clock = PhaseClock()
    batch, events, paused_s = usable_rollout(h, recovery, step)  # the guard's checks of what the rollout returned
    h.run.record_examples(step, "train", batch.examples)
    metrics = {**batch.metrics, "health/paused_s": paused_s}  # the waits are part of the rollout's time
    clock.mark("rollout")
    restarted = h.restart_down_engines()
    metrics["engines/restarted"] = float(len(restarted))
    clock.mark("engine_check")
    h.colocation.for_training()
    metrics["health/step_skipped"] = float(any(e.action == "skip" for e in events))
    if not metrics["health/step_skipped"]:
        metrics.update(train_on(h, recovery, batch, step))
    clock.mark("train")
    back = h.engines_back() if restarted else []
    clock.mark("engine_restart_wait")
    with h.rollouts.weight_push():  # one-step: the stream drains first; fully: the engines pause meanwhile
        clock.mark("drain")
        if h.transport is not None:
            h.colocation.for_weight_push()
            metrics["weight_version"] = int(h.transport.push(str(step + 1)))
    if back:
        ray.get(h.manager.continue_generation.remote(back))
    h.rollouts.pushed(step + 1)
    clock.mark("sync")
    metrics.update({**h.colocation.metrics(), **clock.times(), **trainer_idle(clock), **h.evaluator.metrics()})
    reviewed = h.guard.review(step, metrics)
    events += reviewed
    h.sink.log(step, {**metrics, **event_counts(events, h.guard, step)})  # the step's record, also when it stops
    recovery.report(reviewed)
    recovery.engines.after_push(step, reviewed, batch.samples)  # a re-push the guard asked for, the engines' probe
    return first_rollback(events)


def train_on(h, recovery, batch, step: int) -> dict[str, float]:
    """The trainer's log-probs of the batch, its health signals (stop on a damaged actor), the optimizer steps."""
    from slime_search.health.signals import batch_signals, importance_signals
    from slime_search.ray.train_group import split_into_steps

    config = h.config
    if config.actor.loss.uses_old_log_probs:
        h.group.prepare(batch.samples)
    metrics = batch_signals(batch.samples, step, config.actor.loss.tis_cap)
    recovery.report(h.guard.check_batch(step, metrics))
    metrics.update(h.group.optimize(batch.samples, config.steps_per_rollout, h.guard.skip_above()))
    if config.actor.loss.mis is not None:  # the optimizer steps' batches, as optimize splits the rollout
        parts = split_into_steps(batch.samples, config.steps_per_rollout)
        metrics.update(importance_signals(parts, config.actor.loss.mis, step))
    return metrics


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args, preflight
    from slime_search.utils.sigint import answer_sigint

    answer_sigint()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    preflight(args)  # a retriever that is down is found now, not after Ray started and the models loaded
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import check_model_flags
    from slime_search.health.guard import RunStopped
    from slime_search.health.recovery import STOP_EXIT_CODE, Recovery, repeated_stop
    from slime_search.report import render_report
    from slime_search.run_config import run_config
    from slime_search.run_handles import open_run, start_parts

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    try:
        check_model_flags(args, hf_config)
    except ValueError as err:  # a usage error, said as argparse says one, before Ray starts and the models load
        sys.stderr.write(f"error: {err}\n")
        return 2
    config = run_config(args, hf_config.vocab_size, use_gpu=torch.cuda.is_available())
    refusal = repeated_stop(config.run_dir, argv)
    if refusal is not None:  # the guard stopped this run, and the same command would stop it the same way
        logger.error("%s", refusal)
        return STOP_EXIT_CODE
    h = open_run(config, args)
    recovery = Recovery(h, argv)
    try:
        start_parts(h, args)
        run_steps(h, recovery, recovery.resume())
    except RunStopped as stopped:  # the guard's verdict: the run cannot go on; the report says why as well
        logger.error("run stopped: %s", stopped)
        code = STOP_EXIT_CODE
    else:
        code = 0
    finally:
        h.shut_down()
    logger.info("report: %s", render_report(h.run.path))
    return code


if __name__ == "__main__":
    sys.exit(main())
