"""The evaluation engine beside training (--eval-engine), from the driver's side: EvalEngine.

When a version is due, the actor writes its weights as an HF folder (RUN/eval_weights/step_V.N), shard by shard as
--save-hf does. The evaluator is a second RolloutManager with one engine of its own. It loads that folder and evaluates
it while training goes on, so the step pays for the write only. A result is recorded under the version it evaluated,
whenever it arrives, and the health guard reviews it then. A held-out drop found late still rolls the run back to a
checkpoint from before it.

One evaluation runs at a time. A version that falls due while another is evaluated waits with its folder written. If a
newer one falls due before it starts, the older is skipped (logged, and counted in the record of the newer). So the
evaluator stays at most one version behind. The final version is evaluated too, and the run waits for it, within the
deadline. A rollback drops the evaluations of undone versions. A run killed while an evaluation is pending loses that
one result; the resumed run evaluates the versions due after it.

A version waiting for its evaluation, or being evaluated, keeps its checkpoint (`pending_versions`). --keep-checkpoints
prunes it only after its result has arrived and the guard has seen it. So the guard can roll back to, stop on or end on
every version it has a grade of, however long evaluations take.

The evaluator never ends or hangs the run. An evaluation that fails (an engine out of memory, the actor dead) is
dropped with a warning and counted, and so is one with no result within its deadline. The evaluator is then replaced by
a fresh one, and the old one is killed, since a stuck one never answers. After MAX_FAILURES failures in a row,
evaluation beside training stops for the rest of the run, which goes on without it. The deadline (--eval-timeout) is
by default sized from the questions an evaluation grades (evaluation.flags.eval_deadline_s). `metrics()` goes into
every step's record, so a stuck evaluator shows before its deadline.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FOLDER = "eval_weights"
MAX_FAILURES = 3  # failed evaluations or restarts in a row after which evaluation beside training stops
KILL_WAIT_S = 60.0  # how long a replaced evaluator may take to die (its GPUs are free for the next one only then)
RESTART_RETRY_S = 10.0  # the pause before trying again to start an evaluator


@dataclass
class Pending:
    version: int
    folder: Path
    due_at: float  # time.time() when the version fell due
    ref: Any = None  # the evaluator's answer, once started
    started: float = 0.0  # time.monotonic() when it started: its deadline counts from here
    undone: bool = False  # a rollback undid this version: its result is not recorded


@dataclass
class EvalResult:
    version: int
    metrics: dict[str, float]
    shown: list[dict]
    record: dict[str, float] = field(default_factory=dict)  # timing and lag of this evaluation


class EvalEngine:
    def __init__(
        self,
        evaluator,
        group,
        run_path: str | Path,
        weight_sync,
        examples: int,
        *,
        timeout_s: float = 3600.0,
        restart: Callable[[], Any] | None = None,
        max_failures: int = MAX_FAILURES,
    ):
        """`timeout_s`: the deadline of one evaluation, from its start (loading the weights included). `restart`: makes
        a fresh evaluator actor when one failed (None: the same actor evaluates the next version). `max_failures`
        failures in a row (evaluations or restarts) stop evaluation beside training; the evaluator is killed then."""
        # RolloutManager actor with the eval engine; the driver stops this one at the end (None: killed, none left)
        self.evaluator = evaluator
        self.group = group
        self.folder = Path(run_path) / FOLDER
        shutil.rmtree(self.folder, ignore_errors=True)  # what a killed run left; its results are lost
        self.weight_sync = weight_sync
        self.examples = examples
        self.timeout_s = timeout_s
        self.restart = restart
        self.max_failures = max_failures
        self.running: Pending | None = None
        self.waiting: Pending | None = None
        self.skipped: list[int] = []
        self.submitted = 0
        self.failures = 0  # evaluations dropped for a failure or the deadline, over the run
        self.restarts = 0
        self.failing = 0  # failures and failed restarts since the last result
        self.stopped = False  # too many failures in a row: no more evaluation beside training in this run

    def busy(self) -> bool:
        return self.running is not None or self.waiting is not None

    def pending_versions(self) -> set[int]:
        """The versions whose result is still to come (being evaluated, or waiting to be): their checkpoints stay."""
        pending = [p for p in (self.running, self.waiting) if p is not None and not p.undone]
        return {p.version for p in pending}

    def metrics(self) -> dict[str, float]:
        """The evaluator's state, for every step's record: an evaluation that runs for long is visible before its
        deadline."""
        running_age = time.monotonic() - self.running.started if self.running is not None else 0.0
        return {
            "eval/running_age_s": running_age,
            "eval/failures": float(self.failures),
            "eval/restarts": float(self.restarts),
            "eval/stopped": float(self.stopped),
        }

    def submit(self, version: int) -> float:
        """The actor's weights of `version` to disk, and their evaluation started (or queued behind the running one);
        returns the seconds the actor spent writing (nothing is written once evaluation beside training stopped)."""
        if self.stopped:
            return 0.0
        started = time.perf_counter()
        self.submitted += 1  # a folder per submission: after a rollback the same version may be written again
        folder = self.folder / f"step_{version}.{self.submitted}"  # while the engine still reads the undone one
        sync = self.weight_sync
        self.group.on_all_ranks("write_hf_streamed", sync.hf_checkpoint, str(folder), sync.bucket_bytes)
        pending = Pending(version, folder, time.time())
        if self.running is None:
            self._start(pending)
        else:
            if self.waiting is not None:
                self._skip(
                    self.waiting, f"version {version} fell due while version {self.running.version} was evaluated"
                )
            self.waiting = pending
        return time.perf_counter() - started

    def collect(self, wait: bool = False) -> list[EvalResult]:
        """The results that have arrived (with `wait`, every pending one, each waited for until its deadline), in
        version order; each finished, failed or timed-out evaluation starts the waiting one."""
        import ray

        results = []
        while self.running is not None:
            running = self.running
            left = running.started + self.timeout_s - time.monotonic()
            ready, _ = ray.wait([running.ref], timeout=max(0.0, left) if wait else 0)
            if not ready:
                if time.monotonic() - running.started >= self.timeout_s:
                    self._failed(running, f"no result after {self.timeout_s:g} s (--eval-timeout)")
                elif not wait:
                    break  # still within its deadline; the next step looks again
                continue  # with `wait`, ray.wait may return a moment before the deadline
            try:
                answer = ray.get(running.ref)
            except Exception as err:  # noqa: BLE001 - the evaluator's fault costs this result, never the run
                self._failed(running, f"{type(err).__name__}: {err}")
                continue
            self.running = None
            self.failing = 0
            shutil.rmtree(running.folder, ignore_errors=True)
            self._start_waiting()
            if running.undone:
                logger.info("evaluation of version %d dropped: a rollback undid that version", running.version)
                continue
            record = {
                "time/eval_s": answer["eval_s"],
                "time/eval_load_s": answer["load_s"],
                "eval/wait_s": time.time() - running.due_at,  # from falling due to its result
                "eval/skipped_versions": float(sum(v < running.version for v in self.skipped)),  # since the last
            }
            self.skipped = [v for v in self.skipped if v > running.version]
            results.append(EvalResult(running.version, answer["metrics"], answer["shown"], record))
        return results

    def rolled_back(self, to_step: int) -> None:
        """The run continues from `to_step`: pending evaluations of `to_step` and later are dropped.

        Later versions are of weights that no longer exist. Version `to_step` itself is evaluated again when the loop
        reaches it, so a pending evaluation of it would be recorded twice."""
        if self.waiting is not None and self.waiting.version >= to_step:
            shutil.rmtree(self.waiting.folder, ignore_errors=True)
            self.waiting = None
        if self.running is not None and self.running.version >= to_step:
            self.running.undone = True
        self.skipped = [v for v in self.skipped if v < to_step]

    def _start(self, pending: Pending) -> None:
        pending.ref = self.evaluator.evaluate_weights.remote(str(pending.folder), pending.version, self.examples)
        pending.started = time.monotonic()
        self.running = pending

    def _start_waiting(self) -> None:
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self._start(waiting)

    def _skip(self, pending: Pending, why: str) -> None:
        logger.warning("evaluation of version %d skipped: %s", pending.version, why)
        shutil.rmtree(pending.folder, ignore_errors=True)
        self.skipped.append(pending.version)

    def _failed(self, pending: Pending, cause: str) -> None:
        """The running evaluation failed or passed its deadline: dropped and counted; a fresh evaluator (unless too
        many failed in a row) takes the waiting version."""
        self.running = None
        self.failures += 1
        self.failing += 1
        logger.warning("evaluation of version %d dropped: %s", pending.version, cause)
        self._replace_evaluator()  # first: a stuck evaluator may still read the folder
        shutil.rmtree(pending.folder, ignore_errors=True)
        if self.stopped:
            if self.waiting is not None:
                shutil.rmtree(self.waiting.folder, ignore_errors=True)
                self.waiting = None
            return
        self._start_waiting()

    def _replace_evaluator(self) -> None:
        while self.failing < self.max_failures:
            if self.restart is None:
                return
            self._kill()
            try:
                self.evaluator = self.restart()
            except Exception as err:  # noqa: BLE001 - counted like a failed evaluation; enough of them stop it
                self.failing += 1
                logger.warning("evaluator restart failed: %s: %s", type(err).__name__, err)
                if self.failing < self.max_failures:
                    time.sleep(RESTART_RETRY_S)  # Ray's view of free GPUs lags the dead actor's release
                continue
            self.restarts += 1
            logger.warning("evaluator restarted (%d restart(s) in this run)", self.restarts)
            return
        self._kill()  # a stuck one would hold its engine's GPUs for the rest of the run
        self.stopped = True
        logger.warning(
            "evaluation beside training stops after %d failures in a row; the run goes on without it", self.failing
        )

    def _kill(self) -> None:
        """Kill the evaluator (a stuck one never answers a shutdown; the engines it started get SIGTERM when it dies)
        and wait until Ray has it dead, so that the resources it held are free for a fresh one."""
        import ray

        if self.evaluator is None:
            return
        evaluator, self.evaluator = self.evaluator, None
        ray.kill(evaluator)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:  # the kill takes effect a moment later: an answer means not yet
            try:
                ray.get(evaluator.__ray_ready__.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - RayActorError: dead; GetTimeoutError: given up on; no other ends the run
                return
            time.sleep(0.1)
