"""What the run does with the health guard's decisions: resume, roll back, push again, stop, end on a checkpoint.

All of them go through one path, `serve_checkpoint(k)`: the actor loads checkpoint k and the engines serve its weights.
None of them deletes anything. The checkpoints a rollback or a stop undoes are set aside (RunFolder.carry_out), and
the events name where. The event is recorded before anything moves. A resume finishes a set-aside that a crash cut
short.

Every stop ends the run the same way (`stop`), whichever rule raised it. A stop that concerns the policy ends on the
best checkpoint from before the trouble. A stop that concerns the steps' inputs or the disk (INPUT_RULES) ends on the
newest checkpoint: the weights are not at fault there. RUN/final.json names the weights the run ended on. It does so
whatever the transport, and also when the end's confirmation on fresh questions fails.

A stop exits with STOP_EXIT_CODE, not 1, so a scheduler that restarts failed jobs can tell the guard's verdict from a
crash. Run again unchanged, a stopped run would meet the same rule at the same place. So it refuses to start and says
what to change (`repeated_stop`); with any flag changed, it resumes. A stop for a fault that passes is recorded as
transient (the retriever, a reward service or the --save disk failing past --health-max-outage-hours). The same
command resumes it, since the fault may be gone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from slime_search.health.events import OUTAGE, Decision
from slime_search.health.guard import ACTIONS, BEFORE, Event, RunStopped
from slime_search.health.remedy import lr_scale, remedied_schedule
from slime_search.run.folder import STOPPED

if TYPE_CHECKING:
    from slime_search.run.parts import RunParts

logger = logging.getLogger(__name__)

STOP_EXIT_CODE = 3
ADVICE = {  # what to change before running a stopped run again, by the rule that stopped it
    "reward_errors": "fix the reward plugin (the message names its first error), or allow a share of bad rewards "
    "with --max-reward-error-rate",
    "search_failures": "check the retriever behind --search-url (its log), or raise --max-search-failure-rate",
    "no_trainable_sample": "check the engines and the rollout's errors named above",
    "nonfinite_weights": "the actor's weights are damaged: lower --lr or raise --clip-grad's strictness, then resume",
    "nonfinite_gradient": "lower --lr, or clip harder with --clip-grad",
    "grad_spike": "lower --lr, or raise --health-grad-spike",
    "stop_run": "remove the cause the plugin named (e.g. raise --serper-budget-calls)",
    "disk_full": "free space on the disk of --save, or keep fewer checkpoints with a lower --keep-checkpoints",
    "engine_mismatch": "check the engine the message names: its GPU (nvidia-smi, ECC errors), its SGLang version "
    "(constraints-gpu.txt pins the tested one) and its flags (dtype, quantization, attention backend; its log in the "
    "run folder)",
}
PASSING_ADVICE = {  # what to do after a stop of a fault that passes: the same command resumes once it has
    "search_failures": "once the retriever behind --search-url answers again (its log says why it did not), run the "
    "same command: it resumes; or let the run wait longer with a higher --health-max-outage-hours",
    "reward_errors": "once the service the reward plugin calls answers again (the message names its first error), run "
    "the same command: it resumes; or let the run wait longer with a higher --health-max-outage-hours",
    "disk_full": "free space on the disk of --save, or keep fewer checkpoints with a lower --keep-checkpoints, then run "
    "the same command: it resumes",
}
# stops by what the steps were given or where they are saved, or by an engine that disagrees with the trainer's
# weights (run.engine_check): the weights are not at fault, the run ends on its newest checkpoint (a stop by any
# other rule ends on the best checkpoint from before the trouble)
INPUT_RULES = frozenset({"search_failures", "reward_errors", "stop_run", "disk_full", "engine_mismatch"})
ROLLBACK_ADVICE = (
    "lower --lr, or give the guard more room (--max-rollbacks, --health-rollback-window, or the rule's own bound)"
)


def advice(rule: str, passing: bool = False) -> str:
    """What to do before running a run stopped by `rule` again (`passing`: a stop of a fault that passes)."""
    if passing and rule in PASSING_ADVICE:
        return PASSING_ADVICE[rule]
    return ADVICE.get(rule, ROLLBACK_ADVICE)


def passing_stop(event: Event) -> bool:
    """Whether a stop ended a fault that passes (it lasted past --health-max-outage-hours): the same command may run
    again, the fault may be gone."""
    return OUTAGE in event.values


def repeated_stop(run_dir, argv: list[str]) -> str | None:
    """A run the guard stopped, started again with the very same command, would repeat the stop: what to change
    instead (None when the run was not stopped, or runs with other flags now). Any change of flags resumes it; the
    record of the stop stays in RUN/health.jsonl. A stop of a fault that passes (recorded as transient) never refuses:
    the retriever, the reward service or the disk may be back."""
    from pathlib import Path

    path = Path(run_dir) / STOPPED
    if not path.is_file():
        return None
    stopped = json.loads(path.read_text())
    if stopped.get("transient"):
        event = stopped["event"]
        logger.info(
            "this run was stopped at step %d by a fault that passes (%s); it resumes: the fault may be gone",
            event["step"],
            event["rule"],
        )
        path.unlink()
        return None
    if stopped["argv"] != argv:
        path.unlink()
        return None
    event = stopped["event"]
    return (
        f"this run was stopped by the health guard at step {event['step']} ({event['rule']}): {event['message']}. "
        f"Started again unchanged it would stop the same way: {stopped['advice']}; then run it again "
        f"(or delete {path} to resume it as it is)"
    )


class Recovery:
    """The guard's decisions, carried out on the run's parts (run.parts.RunParts)."""

    def __init__(self, parts: RunParts, argv: list[str] | None = None):
        from slime_search.run.engine_check import EngineCheck

        self.parts = parts
        self.argv = argv or []
        self.lr_scale = 1.0
        self.engines = EngineCheck(self)  # the re-push, the probe of the engines and what follows from it

    # ---- the one path ----------------------------------------------------------------------------------------------
    def serve_checkpoint(self, steps_done: int) -> None:
        """The actor loads the checkpoint of `steps_done` and the engines serve its weights (the disk transport
        leaves them in RUN/weights)."""
        parts = self.parts
        parts.colocation.for_training()
        parts.group.load(str(parts.folder.checkpoints), steps_done)
        if parts.transport is not None:
            parts.colocation.for_weight_push()
            parts.transport.push(str(steps_done))

    def restore(self, steps_done: int) -> None:
        """Actor, data position and engines as they were at the checkpoint of `steps_done`; records of later steps
        are dropped (they are redone)."""
        import ray

        parts = self.parts
        state = parts.folder.rollout_state(steps_done)
        self.serve_checkpoint(steps_done)
        ray.get(parts.manager.load_state_dict.remote(state))
        parts.sink.drop_from(steps_done)
        parts.folder.drop_examples_from(steps_done)

    def resume(self) -> int:
        """Continue after the last complete checkpoint of the run folder, if any; returns the next step. The guard
        replays the records kept, and the remedy of recent rollbacks holds again."""
        import ray

        parts = self.parts
        finished = parts.folder.finish_set_aside()  # a rollback or stop a crash cut short, recorded: done now
        if finished is not None:
            logger.warning(
                "finished setting the checkpoints of steps %s aside (%s)", list(finished.moving), finished.name
            )
        done = parts.folder.latest_checkpoint()
        parts.guard.rollback_steps, parts.guard.rollback_targets = (
            parts.folder.rollback_steps(),
            parts.folder.rollback_targets(),
        )
        parts.folder.record_resume(done or 0, parts.guard.rollbacks)
        if parts.guard.rollbacks:  # the timeline it resumes on samples as it did
            ray.get(parts.manager.set_sampling_attempt.remote(parts.guard.rollbacks))
        self.follow_remedy(done or 0)
        if done is None:
            # a run killed before its first checkpoint starts again from step 0: its records would be duplicated
            dropped = (
                parts.sink.drop_from(0)
                + parts.folder.drop_examples_from(0)
                + parts.folder.drop_events_from(0, parts.guard.rollbacks)
            )
            if dropped:
                logger.info("no checkpoint in %s: dropped %d records of an earlier attempt", parts.folder.path, dropped)
            if parts.config.model.needs_first_push and parts.transport is not None:
                parts.colocation.for_weight_push()
                parts.transport.push("0")
            return 0
        self.restore(done)
        parts.folder.drop_events_from(done, parts.guard.rollbacks)
        parts.guard.replay(
            parts.sink.read(), parts.guard.rollback_steps, parts.folder.eval_grades(), parts.guard.rollback_targets
        )
        logger.info("resumed after step %d", done)
        return done

    # ---- the guard's decisions -------------------------------------------------------------------------------------
    def report(self, events: list[Event]) -> list[Event]:
        """The guard's events: logged, recorded in RUN/health.jsonl; a stop among them is raised to the loop (a
        Decision), which carries it out (`carry_out`)."""
        stop = next((event for event in events if event.action == "stop"), None)
        others = [event for event in events if event is not stop]
        log_events(others)
        self.parts.folder.record_events([event.record(self.parts.guard.rollbacks) for event in others])
        if stop is not None:
            raise Decision(stop)
        return list(events)

    def carry_out(self, event: Event) -> int:
        """A decision that reached the loop: a rollback returns the step to go on from; a stop ends the run."""
        if event.action == "stop":
            self.stop(event)
        if event.action != "rollback":
            raise ValueError(f"the loop carries out rollbacks and stops, not {event.action!r}: {event.message}")
        return self.roll_back(event)

    def record_eval(self, result, step: int) -> Event | None:
        """A held-out evaluation, recorded under the version it evaluated (at step `step`, later when it ran beside
        training) and reviewed by the guard; returns the rollback it calls for, if any (a stop is raised)."""
        from slime_search.rollout.eval_metrics import GRADES

        parts = self.parts
        metrics = dict(result.metrics)
        grades = metrics.pop(GRADES, None)  # per question, in the eval set's order: kept apart from the metrics
        if grades is not None:
            parts.folder.record_grades(result.version, grades)
        record = {**metrics, **result.record, "weight_version": result.version}
        parts.sink.log(result.version, {**record, "eval/lag_steps": step - result.version})
        parts.folder.record_examples(result.version, "eval", result.shown)
        events = [self.name_target(event) for event in parts.guard.review_eval(result.version, metrics, grades)]
        return next((event for event in self.report(events) if event.action == "rollback"), None)

    def name_target(self, event: Event) -> Event:
        """A watched held-out fall, with the checkpoint a rollback would go back to now. That is the rollback policy's
        choice among the checkpoints on disk. It can be older than the last version within the margin, since a warning
        near that version leaves its checkpoint unconfirmed."""
        if event.action != "watch" or BEFORE not in event.values:
            return event
        target = self.parts.guard.rollback_target(self.parts.folder.checkpoint_steps(), int(event.values[BEFORE]))
        where = "no checkpoint qualifies yet" if target is None else f"the checkpoint of step {target}"
        return replace(event, message=f"{event.message}; a rollback now would go back to {where}")

    def repush(self, version: int) -> None:
        """The engines served other weights than the trainer's, or seemed to: push the current ones again (each
        transport checks the version the engines then serve); the probe follows (run.engine_check)."""
        parts = self.parts
        if parts.transport is None:
            return
        parts.colocation.for_weight_push()
        served = parts.transport.push(str(version))
        logger.warning("weights of version %d pushed again; the engines serve version %s", version, served)

    def roll_back(self, event: Event) -> int:
        """Back to the newest checkpoint that stayed healthy before the trouble began, with the remedy of one more
        recent rollback; returns the step to continue from. Stops the run (ending on the best checkpoint from before
        the trouble) when the budget of recent rollbacks is spent or no checkpoint qualifies. The loop starts the
        rollouts again from the returned step, with the remedy's schedule (RunParts.start_rollouts)."""
        import ray

        parts = self.parts
        before = int(event.values.get(BEFORE, event.step))
        kept = parts.folder.checkpoint_steps()
        target = parts.guard.rollback_target(kept, before)
        passed_over = target != parts.guard.policy.target(kept, before)
        if not parts.guard.rollback_left(event.step):
            budget = f"--max-rollbacks {parts.config.health.max_rollbacks} within --health-rollback-window"
            self.stop(event, f"no rollback left ({budget} {parts.config.health.rollback_window})", before)
        if target is None:
            self.stop(event, f"no checkpoint at or before step {before} stayed healthy to roll back to", before)
        parts.schedule.stop()
        plan = parts.folder.plan_set_aside(target, f"rollback-at-step-{event.step}")
        parts.guard.rolled_back(target, event.step)
        schedule = remedied_schedule(parts.config.schedule, parts.guard.rollbacks)
        self.follow_remedy(target)
        message = f"back to the checkpoint of step {target} ({event.rule} at step {event.step}); lr x{self.lr_scale:g}"
        if schedule.mode != "off":
            message += f", --async-mode {schedule.mode} (max staleness {schedule.staleness})"
        if passed_over:
            message += "; the checkpoint a recent rollback went back to was passed over: the trouble came back from it"
        if plan.moving:
            message += (
                f"; the checkpoints of steps {list(plan.moving)} it undid are kept in {parts.folder.undone / plan.name}"
            )
        values = {"to_step": float(target), "lr_scale": self.lr_scale, "max_staleness": float(schedule.staleness)}
        done = Event(event.step, "rollback", event.rule, message, {**values, "set_aside": float(len(plan.moving))})
        log_events([done])
        parts.folder.carry_out(plan, done.record(parts.guard.rollbacks))  # recorded first, then moved
        self.restore(target)
        ray.get(parts.manager.set_sampling_attempt.remote(parts.guard.rollbacks))  # the redone steps draw afresh
        parts.evaluator.rolled_back(target)
        return target

    def stop(self, event: Event, why: str | None = None, before: int | None = None) -> NoReturn:
        """The run ends on the best checkpoint from before the trouble (RollbackPolicy.stop_target; the trouble began
        after `before`, by default the event's own bound or step), the newer ones set aside so that a resume starts
        there; a stop of INPUT_RULES (the weights are not at fault) on the newest checkpoint. The stop is recorded
        (with RUN/stopped.json, transient for a fault that passes, and RUN/final.json) and raised (RunStopped)."""
        parts = self.parts
        message, values = event.message if why is None else f"{event.message}; {why}", dict(event.values)
        before = int(event.values.get(BEFORE, event.step)) if before is None else before
        inputs = event.rule in INPUT_RULES
        ending = (
            parts.folder.latest_checkpoint()
            if inputs
            else parts.guard.policy.stop_target(parts.folder.checkpoint_steps(), before)
        )
        plan = None
        if ending is not None:
            parts.schedule.stop()
            plan = parts.folder.plan_set_aside(ending, f"stop-at-step-{event.step}")
            message += f"; the run ends on the checkpoint of step {ending}"
            if inputs:
                message += " (the newest: the weights are not at fault)"
            if plan.moving:
                message += (
                    f" (the checkpoints of steps {list(plan.moving)} are kept in {parts.folder.undone / plan.name})"
                )
            values["ended_on"] = float(ending)
        else:
            message += (
                f"; no checkpoint at or before step {before}: the run ends on the unsaved weights of step {event.step}"
            )
        stop = Event(event.step, "stop", event.rule, message, values)
        record = stop.record(parts.guard.rollbacks)
        log_events([stop])
        passing = passing_stop(stop)
        # the same command again refuses from here on, unless the fault passes
        parts.folder.record_stop(self.argv, record, advice(stop.rule, passing), transient=passing)
        if plan is not None:
            parts.folder.carry_out(plan, record)  # recorded first, then moved
        else:
            parts.folder.record_events([record])
        reason = f"stopped by the health guard ({event.rule} at step {event.step})"
        parts.folder.record_final(ending, reason, parts.config.save_hf, at_step=event.step)
        if ending is not None and stop.rule != "disk_full":  # a full disk could not take the engines' copy
            self.serve_checkpoint(ending)
        raise RunStopped(f"{stop.message} (to go on: {advice(stop.rule, passing)})")

    def follow_remedy(self, step: int) -> None:
        """The learning rate of the rollbacks still recent at `step`: lowered by each, restored as they age out of
        --health-rollback-window."""
        scale = lr_scale(self.parts.config.health.lr_factor, self.parts.guard.recent_rollbacks(step))
        if scale != self.lr_scale:
            if scale > self.lr_scale:
                logger.info("step %d: a rollback is no longer recent; learning rate x%g again", step, scale)
            self.parts.group.set_lr_scale(scale)
            self.lr_scale = scale

    def end(self, steps_done: int) -> None:
        """After the final evaluation: a run whose held-out metric declined late ends on its best evaluated
        checkpoint (HealthGuard.end_on_best; a decline the evaluations cannot tell from chance is confirmed on
        questions they left out first, `confirm_on_fresh`); RUN/final.json names the weights the run ended on either
        way, and why. A confirmation that fails (an error, no result within its deadline) ends the run on its last
        weights, and final.json says so. The later checkpoints stay: the records and a resume with more rollouts
        continue from the last."""
        parts = self.parts
        checkpoints = parts.folder.checkpoint_steps()
        event, why_last, served = parts.guard.end_on_best(checkpoints), "the last step", False
        candidate = parts.guard.end_candidate(checkpoints) if event is None else None
        if candidate is not None:
            try:
                event, why_last = self.confirm_on_fresh(candidate[0], steps_done)
            except Exception as err:  # noqa: BLE001 - the confirmation's fault costs the confirmation, not the end
                why_last = (
                    f"the last step: the late fall to the checkpoint of step {candidate[0]} could not be confirmed on "
                    f"questions the evaluations did not grade ({type(err).__name__}: {err})"
                )
                logger.warning("health: %s", why_last)
            served = event is not None  # the confirmation left the checkpoint served
        if event is None:
            parts.folder.record_final(steps_done, why_last, parts.config.save_hf)
            return
        target = int(event.values["ended_on"])
        if not served:
            self.serve_checkpoint(target)
        parts.folder.record_final(target, f"the best held-out evaluation: {event.message}", parts.config.save_hf)
        self.report([event])

    def fresh_questions(self):
        """(the questions of the eval sets the evaluations left out, at most --health-end-confirm of each set; how many
        there are over all sets), or None when the evaluations grade every question or nothing is left out."""
        from slime_search.evaluation.subsets import UngradedQuestions
        from slime_search.rollout.manager import evaluation_sizes

        rollout = self.parts.config.rollout
        subset, size = rollout.eval_subset, self.parts.config.health.end_confirm
        if not size or (subset.size is None and subset.width is None):
            return None
        questions = UngradedQuestions(subset, size)
        count = sum(evaluation_sizes(rollout.eval_sets, questions).values())
        return (questions, count) if count else None

    def confirm_on_fresh(self, version: int, steps_done: int) -> tuple[Event | None, str]:
        """The final weights and checkpoint `version` graded on fresh questions, paired: the event to end on the
        checkpoint if it is better there beyond chance, else None and the final weights served again. Each of the two
        evaluations has the deadline of one evaluation of that many questions (--eval-timeout)."""
        import ray
        from ray.exceptions import GetTimeoutError

        from slime_search.evaluation.flags import eval_deadline_s
        from slime_search.rollout.eval_metrics import GRADES

        parts = self.parts
        fresh = self.fresh_questions()
        if fresh is None:  # every question of every set was graded: nothing to confirm on
            return None, "the last step"
        questions, count = fresh
        deadline_s = eval_deadline_s(count, parts.config.eval_timeout)

        def fresh_grades() -> list[float]:
            parts.colocation.for_generation()
            try:
                metrics, _ = ray.get(parts.manager.evaluate.remote(0, questions), timeout=deadline_s)
            except GetTimeoutError:
                raise TimeoutError(
                    f"no result within {deadline_s:.0f} s for {count} questions (--eval-timeout)"
                ) from None
            return metrics[GRADES]

        logger.info(
            "health: the final held-out evaluation fell late and not beyond chance; confirming on %d questions "
            "the evaluations did not grade (the final weights, then the checkpoint of step %d)",
            count,
            version,
        )
        final = fresh_grades()
        if len(final) < 2:  # the evaluations left (almost) nothing out
            return None, "the last step"
        self.serve_checkpoint(version)
        try:
            best = fresh_grades()
        except BaseException:
            self.serve_checkpoint(steps_done)  # the final weights again: the run ends on them
            raise
        event = parts.guard.end_on_confirmed(version, best, final)
        if event is not None:
            return event, ""
        self.serve_checkpoint(steps_done)  # the final weights again
        on = f"{sum(final) / len(final):.3f} against {sum(best) / len(best):.3f}"
        why = f"the last step: the late fall was not confirmed on {len(final)} questions the evaluations did not grade "
        why += f"(the final weights {on} for the checkpoint of step {version})"
        logger.info("health: %s", why)
        return None, why


def log_events(events: list[Event]) -> None:
    # a watch needs nothing from the user, nor does a probe's result (an engine that disagrees is restarted, a warning)
    for event in events:
        log = logger.info if event.action in ("watch", "probe") else logger.warning
        log("health %s (%s): %s", event.action, event.rule, event.message)


def event_counts(events, guard, step: int) -> dict[str, float]:
    """Every kind of decision of the step, counted in its record, and the rollbacks done and still recent."""
    # a watch comes from a held-out evaluation, recorded under the version it evaluated, never from a step; a probe and
    # an engine's restart follow the step's record (run.engine_check): lines of health.jsonl, not counts
    uncounted = ("watch", "probe", "restart_engine")
    counts = {f"health/{a}s": float(sum(e.action == a for e in events)) for a in ACTIONS if a not in uncounted}
    return {
        **counts,
        "health/rollbacks": float(guard.rollbacks),
        "health/recent_rollbacks": guard.recent_rollbacks(step),
    }
