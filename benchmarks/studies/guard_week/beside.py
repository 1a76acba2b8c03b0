"""Evaluation beside training on the world's clock: EvalEngine's contract (slime_search.run.eval_engine), which the real
BesideEval drives (`submit`, `collect`, `pending_versions`, `metrics`, `rolled_back`, `evaluator`).

The real EvalEngine times its evaluations with the machine's clock and Ray's object refs, which a simulation cannot
advance; this one follows its rules on the world's clock instead. One evaluation runs at a time. A version due while
another runs waits, and a newer one due meanwhile skips it. A waiting version starts when the driver next looks. Each
evaluation has the deadline of --eval-timeout from its start (the product's, sized from the questions it grades). One
past it is dropped and the evaluator restarted; after MAX_FAILURES in a row, evaluation beside training stops. A
rollback drops the evaluations of undone versions. At the end every pending one is waited for. An evaluation grades the
weights of its version as the actor wrote them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.studies.guard_week.world import Weights, World

MAX_FAILURES = 3  # slime_search.run.eval_engine.MAX_FAILURES


@dataclass
class Pending:
    version: int
    weights: Weights
    due_at: float
    started: float = 0.0
    finish: float = math.inf  # when its result is there (never, for one that hangs)
    load_s: float = 0.0
    undone: bool = False


class SimEvalBeside:
    evaluator = None  # the evaluator's RolloutManager: none runs

    def __init__(self, world: World, manager, group, timeout_s: float, max_failures: int = MAX_FAILURES):
        self.world, self.manager, self.group = world, manager, group
        self.timeout_s, self.max_failures = timeout_s, max_failures
        self.questions = sum(world.week.eval_sizes.values())
        self.running: Pending | None = None
        self.waiting: Pending | None = None
        self.skipped: list[int] = []
        self.failures = self.restarts = self.failing = 0
        self.stopped = False
        self.ready_at = 0.0  # a restarted evaluator answers from then (its engine loads first)

    def pending_versions(self) -> set[int]:
        return {p.version for p in (self.running, self.waiting) if p is not None and not p.undone}

    def metrics(self) -> dict[str, float]:
        now = self.world.clock.now()
        return {
            "eval/running_age_s": now - self.running.started if self.running is not None else 0.0,
            "eval/failures": float(self.failures),
            "eval/restarts": float(self.restarts),
            "eval/stopped": float(self.stopped),
        }

    def submit(self, version: int) -> float:
        if self.stopped:
            return 0.0
        w = self.world
        seconds = w.shape.timing.handover_s
        w.clock.sleep(seconds)
        pending = Pending(version, self.group.weights, w.clock.now())
        if self.running is None:
            self._start(pending)
        else:
            if self.waiting is not None:
                self.skipped.append(self.waiting.version)
            self.waiting = pending
        return seconds

    def collect(self, wait: bool = False):
        from slime_search.run.eval_engine import EvalResult

        w, results = self.world, []
        while self.running is not None:
            running, now = self.running, w.clock.now()
            deadline = running.started + self.timeout_s
            if running.finish > now:
                if now >= deadline:
                    self._failed(running)
                    continue
                if not wait:
                    break
                w.clock.advance_to(min(running.finish, deadline))
                continue
            self.running, self.failing = None, 0
            self._start_waiting()
            if running.undone:
                continue
            record = {
                "time/eval_s": running.finish - running.started - running.load_s,
                "time/eval_load_s": running.load_s,
                "eval/wait_s": running.finish - running.due_at,
                "eval/skipped_versions": float(sum(v < running.version for v in self.skipped)),
            }
            self.skipped = [v for v in self.skipped if v > running.version]
            results.append(EvalResult(running.version, w.grade(running.weights), [], record))
        return results

    def rolled_back(self, to_step: int) -> None:
        if self.waiting is not None and self.waiting.version >= to_step:
            self.waiting = None
        if self.running is not None and self.running.version >= to_step:
            self.running.undone = True
        self.skipped = [v for v in self.skipped if v < to_step]

    def _start(self, pending: Pending) -> None:
        w = self.world
        pending.started = max(w.clock.now(), self.ready_at)
        pending.load_s = w.shape.timing.eval_load_s
        if not w.due("eval_hang", pending.version):
            pending.finish = pending.started + w.eval_seconds(self.questions, load=True)
        self.running = pending

    def _start_waiting(self) -> None:
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self._start(waiting)

    def _failed(self, pending: Pending) -> None:
        w = self.world
        self.running = None
        self.failures += 1
        self.failing += 1
        w.facts.eval_blind_s += w.clock.now() - pending.started
        if self.failing < self.max_failures:
            self.restarts += 1
            self.ready_at = w.clock.now() + w.shape.timing.engine_restart_s
            w.note(self.manager.step, "evaluator_restart", "eval_timeout")
            self._start_waiting()
            return
        self.stopped = True
        self.waiting = None
        w.note(self.manager.step, "evaluation_stopped", "eval_timeout")
