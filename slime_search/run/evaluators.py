"""Held-out evaluation, as the driver sees it: one interface, two ways.

    results(step)   the evaluations that have a result at this point of the loop (each an EvalResult)
    pending_versions()  the versions whose result is still to come (pruning keeps their checkpoints)
    metrics()       what goes into every step's record about the evaluator
    rolled_back(k)  the run continues from step k: evaluations of undone versions are dropped

InStepEval: the rollout engines evaluate a version when it falls due (--eval-interval) and the step waits for it,
within the deadline of --eval-timeout (by default sized from the questions graded); past it the run ends with an error
(a stuck engine or manager is not waited on for good; run again, the run resumes from its last checkpoint).
BesideEval (--eval-engine): an engine of its own evaluates beside training (slime_search.run.eval_engine.EvalEngine,
started by run.parts.start_beside); the step pays for writing the weights only, and a result is reviewed when it
arrives.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from slime_search.run.eval_engine import EvalResult

if TYPE_CHECKING:
    from slime_search.ray.colocation import Colocation
    from slime_search.run.config import RunConfig
    from slime_search.run.protocols import EvaluationsBeside, RemoteManager

logger = logging.getLogger(__name__)


def eval_deadline(config: RunConfig) -> tuple[float, int]:
    """(seconds one evaluation of the run may take, the questions it grades): --eval-timeout, else sized from them."""
    from slime_search.evaluation.flags import eval_deadline_s
    from slime_search.rollout.manager import evaluation_sizes

    questions = sum(evaluation_sizes(config.rollout.eval_sets, config.rollout.eval_subset).values())
    return eval_deadline_s(questions, config.eval_timeout), questions


class InStepEval:
    def __init__(self, config: RunConfig, manager: RemoteManager):
        self.config = config
        self.manager = manager
        self.deadline: tuple[float, int] | None = None  # eval_deadline, once an evaluation is due

    def results(self, step: int) -> list[EvalResult]:
        from slime_search.rollout.progress import wait_with_progress

        if not self.config.eval_due(step):
            return []
        if self.deadline is None:
            self.deadline = eval_deadline(self.config)
        deadline_s, questions = self.deadline
        started = time.perf_counter()
        evaluation = self.manager.evaluate.remote(self.config.log_rollout_examples)
        try:
            metrics, shown = wait_with_progress(self.manager, evaluation, "eval", deadline_s)
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
    def __init__(self, config: RunConfig, colocation: Colocation, beside: EvaluationsBeside):
        self.config = config
        self.colocation = colocation
        self.beside = beside
        self.handover_s = 0.0

    def results(self, step: int) -> list[EvalResult]:
        """A due version's weights go to the evaluator (the colocated actor's weights must be on its device to be
        written); the results that arrived come back, and at the end all of them (each within its deadline)."""
        self.handover_s = 0.0
        if self.config.eval_due(step):
            self.colocation.for_weight_push()
            self.handover_s = self.beside.submit(step)
            self.colocation.for_generation()
        return self.beside.collect(wait=step >= self.config.num_rollout)

    def pending_versions(self) -> set[int]:
        return self.beside.pending_versions()

    def metrics(self) -> dict[str, float]:
        return {**self.beside.metrics(), "time/eval_handover_s": self.handover_s}

    def rolled_back(self, to_step: int) -> None:
        self.beside.rolled_back(to_step)
