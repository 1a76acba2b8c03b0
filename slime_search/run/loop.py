"""The training loop. Per step: the held-out evaluations that are due, then rollout -> the guard's checks -> GRPO step
-> weight push -> the guard's review.

Every decision of the guard reaches the loop one way. It is raised as a Decision where it is made: a stop from any
check, a rollback from the review of a step or of an evaluation. The recovery carries it out at the top of the loop. A
rollback returns the step the run goes on from; a stop ends the run (RunStopped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime_search.health.events import Decision, Event

if TYPE_CHECKING:
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery


def run_steps(parts: RunParts, recovery: Recovery, start: int) -> None:
    """Steps `start`.. of the run, from each rollback's step again."""
    while True:
        try:
            return run_from(parts, recovery, start)
        except Decision as decision:
            start = recovery.carry_out(decision.event)


def run_from(parts: RunParts, recovery: Recovery, step: int) -> None:
    """From the weights of `step` to the end: checkpoints every --save-interval steps (a full --save disk is waited
    out); at the end the final evaluation, and the weights the run ends on."""
    from slime_search.run.pauses import save_checkpoint

    if parts.first_checkpoint_due(step):
        save_checkpoint(parts, recovery, 0)  # the rollback target before a later checkpoint proves healthy
    parts.start_rollouts(step)
    while True:
        if step == parts.config.num_rollout:
            parts.schedule.stop()  # what is in flight is cancelled: the final evaluation runs alone
        evaluate(parts, recovery, step)
        if step >= parts.config.num_rollout:
            return recovery.end(step)
        train_step(parts, recovery, step)
        if parts.config.save_due(step + 1):
            save_checkpoint(parts, recovery, step + 1)
        step += 1
        recovery.follow_remedy(step)


def evaluate(parts: RunParts, recovery: Recovery, step: int) -> None:
    """The evaluations with a result now, recorded under the versions they evaluated and reviewed by the guard; the
    first rollback one calls for is raised (results after it are of versions the rollback undoes)."""
    parts.colocation.for_generation()
    for result in parts.evaluator.results(step):
        rollback = recovery.record_eval(result, step)
        if rollback is not None:
            raise Decision(rollback)


def decide(events: list[Event]) -> None:
    """The first rollback among `events`, raised to the loop (stops are raised as they are reported)."""
    rollback = next((event for event in events if event.action == "rollback"), None)
    if rollback is not None:
        raise Decision(rollback)


def train_step(parts: RunParts, recovery: Recovery, step: int) -> None:
    """One step: its batch, the checks before training, the update, the weight push, the step's record and the
    guard's review of it.

    A rollout that a passing fault broke is done again after a wait (run.pauses). Then the rollback the guard calls
    for, if any, is raised."""
    import ray

    from slime_search.metrics import PhaseClock, trainer_idle
    from slime_search.run.pauses import usable_rollout
    from slime_search.run.recovery import event_counts

    clock = PhaseClock()
    batch, events, paused_s = usable_rollout(parts, recovery, step)  # the guard's checks of what the rollout returned
    parts.folder.record_examples(step, "train", batch.examples)
    metrics = {**batch.metrics, "health/paused_s": paused_s}  # the waits are part of the rollout's time
    clock.mark("rollout")
    restarted = parts.restart_down_engines()
    metrics["engines/restarted"] = float(len(restarted))
    clock.mark("engine_check")
    parts.colocation.for_training()
    metrics["health/step_skipped"] = float(any(e.action == "skip" for e in events))
    if not metrics["health/step_skipped"]:
        metrics.update(train_on(parts, recovery, batch, step))
    clock.mark("train")
    back = parts.engines_back() if restarted else []
    clock.mark("engine_restart_wait")
    with parts.schedule.weight_push():  # one-step: the stream drains first; fully: the engines pause meanwhile
        clock.mark("drain")
        if parts.transport is not None:
            parts.colocation.for_weight_push()
            metrics["weight_version"] = int(parts.transport.push(str(step + 1)))
    if back:
        ray.get(parts.manager.continue_generation.remote(back))
    parts.schedule.pushed(step + 1)
    clock.mark("sync")
    metrics.update({**parts.colocation.metrics(), **clock.times(), **trainer_idle(clock), **parts.evaluator.metrics()})
    reviewed = parts.guard.review(step, metrics)
    events += reviewed
    parts.sink.log(
        step, {**metrics, **event_counts(events, parts.guard, step)}
    )  # the step's record, also when it stops
    recovery.report(reviewed)
    recovery.engines.after_push(step, reviewed, batch.samples)  # a re-push the guard asked for, the engines' probe
    decide(events)


def train_on(parts: RunParts, recovery: Recovery, batch, step: int) -> dict[str, float]:
    """The trainer's log-probs of the batch, its health signals (stop on a damaged actor), the optimizer steps."""
    from slime_search.health.signals import batch_signals, importance_signals
    from slime_search.ray.train_group import split_into_steps

    config = parts.config
    if config.actor.loss.uses_old_log_probs:
        parts.group.prepare(batch.samples)
    metrics = batch_signals(batch.samples, step, config.actor.loss.tis_cap)
    recovery.report(parts.guard.check_batch(step, metrics))
    metrics.update(parts.group.optimize(batch.samples, config.steps_per_rollout, parts.guard.skip_above()))
    if config.actor.loss.mis is not None:  # the optimizer steps' batches, as optimize splits the rollout
        step_batches = split_into_steps(batch.samples, config.steps_per_rollout)
        metrics.update(importance_signals(step_batches, config.actor.loss.mis, step))
    return metrics
