"""Evaluation beside training (--eval-engine), from the driver's side.

When a version is due for evaluation, the actor writes its weights as an HF folder (RUN/eval_weights/step_V.N, streamed
shard by shard as --save-hf does) and the evaluator, a second RolloutManager with one engine of its own, loads that
folder and evaluates it while training goes on. The step pays for the write only. A result is recorded under the
version it evaluated, whenever it arrives, and the health guard reviews it then: a held-out drop found late still
rolls the run back to a checkpoint from before it.

One evaluation runs at a time. A version that falls due while another is evaluated waits with its folder written; if
a newer one falls due before it starts, the older is skipped (logged, and counted in the record of the newer): the evaluator
stays at most one version behind instead of falling further behind every interval. The final version is always
evaluated, and the run waits for it. A rollback drops what evaluated or waits to evaluate an undone version. A run
killed while an evaluation is pending loses that one result; the resumed run evaluates the versions due after it.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FOLDER = "eval_weights"


@dataclass
class Pending:
    version: int
    folder: Path
    due_at: float  # time.time() when the version fell due
    ref: Any = None  # the evaluator's answer, once started
    undone: bool = False  # a rollback undid this version: its result is not recorded


@dataclass
class EvalResult:
    version: int
    metrics: dict[str, float]
    shown: list[dict]
    record: dict[str, float] = field(default_factory=dict)  # timing and lag of this evaluation


class EvalBeside:
    def __init__(self, evaluator, group, run_path: str | Path, weight_sync, examples: int):
        self.evaluator = evaluator  # RolloutManager actor with the eval engine
        self.group = group
        self.folder = Path(run_path) / FOLDER
        shutil.rmtree(self.folder, ignore_errors=True)  # what a killed run left; its results are lost
        self.weight_sync = weight_sync
        self.examples = examples
        self.running: Pending | None = None
        self.waiting: Pending | None = None
        self.skipped: list[int] = []
        self.submitted = 0

    def busy(self) -> bool:
        return self.running is not None or self.waiting is not None

    def submit(self, version: int) -> float:
        """The actor's weights of `version` to disk, and their evaluation started (or queued behind the running one);
        returns the seconds the actor spent writing."""
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
        """The results that have arrived (with `wait`, every pending one), in version order; each finished evaluation
        starts the waiting one."""
        import ray

        results = []
        while self.running is not None:
            ready, _ = ray.wait([self.running.ref], timeout=None if wait else 0)
            if not ready:
                break
            done, self.running = self.running, None
            answer = ray.get(done.ref)  # an evaluator that failed fails the run, as an evaluation inside the step would
            shutil.rmtree(done.folder, ignore_errors=True)
            if self.waiting is not None:
                self._start(self.waiting)
                self.waiting = None
            if done.undone:
                logger.info("evaluation of version %d dropped: a rollback undid that version", done.version)
                continue
            record = {
                "time/eval_s": answer["eval_s"],
                "time/eval_load_s": answer["load_s"],
                "eval/wait_s": time.time() - done.due_at,  # from falling due to its result
                "eval/skipped_versions": float(sum(v < done.version for v in self.skipped)),  # since the last
            }
            self.skipped = [v for v in self.skipped if v > done.version]
            results.append(EvalResult(done.version, answer["metrics"], answer["shown"], record))
        return results

    def rolled_back(self, to_step: int) -> None:
        """The run continues from `to_step`: evaluations of later versions are of weights that no longer exist, and
        version `to_step` itself is evaluated again when the loop reaches it (its records were dropped with the later
        ones), so a pending evaluation of it would be recorded twice."""
        if self.waiting is not None and self.waiting.version >= to_step:
            shutil.rmtree(self.waiting.folder, ignore_errors=True)
            self.waiting = None
        if self.running is not None and self.running.version >= to_step:
            self.running.undone = True
        self.skipped = [v for v in self.skipped if v < to_step]

    def _start(self, pending: Pending) -> None:
        pending.ref = self.evaluator.evaluate_weights.remote(str(pending.folder), pending.version, self.examples)
        self.running = pending

    def _skip(self, pending: Pending, why: str) -> None:
        logger.warning("evaluation of version %d skipped: %s", pending.version, why)
        shutil.rmtree(pending.folder, ignore_errors=True)
        self.skipped.append(pending.version)
