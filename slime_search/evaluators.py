"""Held-out evaluation, as the driver sees it: one interface, two ways.

    results(step)   the evaluations that have a result at this point of the loop (each an EvalResult)
    pending_versions()  the versions whose result is still to come (pruning keeps their checkpoints)
    metrics()       what goes into every step's record about the evaluator
    rolled_back(k)  the run continues from step k: evaluations of undone versions are dropped
    manager         the RolloutManager actor it owns (stopped at the end), or None

InStepEval: the rollout engines evaluate a version when it falls due (--eval-interval) and the step waits for it,
within the deadline of --eval-timeout (by default sized from the questions graded); past it the run ends with an error
(a stuck engine or manager is not waited on for good; run again, the run resumes from its last checkpoint).
BesideEval (--eval-engine): an engine of its own evaluates beside training (slime_search.eval_beside.EvalBeside); the
step pays for writing the weights only, and a result is reviewed when it arrives.
"""

from __future__ import annotations

import logging
import time

from slime_search.eval_beside import EvalResult

logger = logging.getLogger(__name__)


def eval_deadline(config) -> tuple[float, int]:
    """(seconds one evaluation of the run may take, the questions it grades): --eval-timeout, else sized from them."""
    from slime_search.evaluation.flags import eval_deadline_s
    from slime_search.rollout.manager import evaluation_sizes

    questions = sum(evaluation_sizes(config.rollout.eval_sets, config.rollout.eval_subset).values())
    return eval_deadline_s(questions, config.eval_timeout), questions


class InStepEval:
    manager = None  # the rollout engines evaluate: nothing of its own to stop

    def __init__(self, handles):
        self.h = handles
        self.deadline: tuple[float, int] | None = None  # eval_deadline, once an evaluation is due

    def results(self, step: int) -> list[EvalResult]:
        from slime_search.rollout.progress import wait_with_progress

        h = self.h
        if not h.config.eval_due(step):
            return []
        if self.deadline is None:
            self.deadline = eval_deadline(h.config)
        deadline_s, questions = self.deadline
        started = time.perf_counter()
        evaluation = h.manager.evaluate.remote(h.config.log_rollout_examples)
        try:
            metrics, shown = wait_with_progress(h.manager, evaluation, "eval", deadline_s)
        except TimeoutError:
            raise TimeoutError(
                f"the evaluation of version {step} ({questions} questions) had no result within {deadline_s:.0f} s "
                "(--eval-timeout): the engines or the rollout manager are stuck, or evaluations take longer here "
                "(then raise --eval-timeout); run again, the run resumes from its last checkpoint"
            ) from None
        return [EvalResult(step, metrics, shown, {"time/eval_s": time.perf_counter() - started})]

    def pending_versions(self) -> set[int]:
        return set()  # an evaluation inside the step has its result before the step goes on

    def metrics(self) -> dict[str, float]:
        return {}

    def rolled_back(self, to_step: int) -> None:
        """Nothing pending: an evaluation inside the step is done before the step goes on."""


class BesideEval:
    def __init__(self, handles, beside):
        self.h = handles
        self.beside = beside
        self.handover_s = 0.0

    @classmethod
    def start(cls, handles, args) -> BesideEval:
        """The evaluator's RolloutManager with its engine, started now; a failed one is replaced by a new one."""
        from slime_search.eval_beside import EvalBeside
        from slime_search.ray.placement import create_eval_manager

        config = handles.config

        def new_evaluator():
            return create_eval_manager(config.eval_engine, args, handles.group)

        deadline_s, questions = eval_deadline(config)
        logger.info("evaluation beside training: %d questions, each evaluation within %.0f s", questions, deadline_s)
        beside = EvalBeside(
            new_evaluator(),
            handles.group,
            handles.run.path,
            config.weight_sync,
            config.log_rollout_examples,
            timeout_s=deadline_s,
            restart=new_evaluator,
        )
        return cls(handles, beside)

    @property
    def manager(self):
        return self.beside.evaluator

    def results(self, step: int) -> list[EvalResult]:
        """A due version's weights go to the evaluator (the colocated actor's weights must be on its device to be
        written); the results that arrived come back, and at the end all of them (each within its deadline)."""
        h = self.h
        self.handover_s = 0.0
        if h.config.eval_due(step):
            h.colocation.for_weight_push()
            self.handover_s = self.beside.submit(step)
            h.colocation.for_generation()
        return self.beside.collect(wait=step >= h.config.num_rollout)

    def pending_versions(self) -> set[int]:
        return self.beside.pending_versions()

    def metrics(self) -> dict[str, float]:
        return {**self.beside.metrics(), "time/eval_handover_s": self.handover_s}

    def rolled_back(self, to_step: int) -> None:
        self.beside.rolled_back(to_step)
