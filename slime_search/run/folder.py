"""What a training run keeps in its folder besides the metrics (metrics.jsonl, slime_search.metrics). It keeps the
rollouts shown in the report (rollouts.jsonl) and the health guard's events (health.jsonl). Per checkpoint it keeps the
rollout state (the data position) next to the actor's torch_dist files (checkpoints/iter_N/, written with them). A
resumed run drops what was recorded after its last complete checkpoint, except the rollbacks and stops of the guard.
They changed the run's course (a rollback's remedy holds while it is recent), and they stay in its history.

Nothing the guard does deletes a checkpoint: the checkpoints a rollback or a stop undoes (and their HF copies) are
moved to checkpoints/undone/NNN-WHY/ (and hf/undone/NNN-WHY/). NNN rises with every set and is never used twice, even
once pruning has removed a set. The last one taken is kept in checkpoints/undone/last_number.txt. So the sets sort by
when they were made. A set-aside is written down (checkpoints/undone/pending.json, with the guard's event of it) before
anything moves. A resumed run finishes one a crash cut short, so the tracker, the folders and the records agree.
Only --keep-checkpoints removes checkpoints. It keeps the newest N of the current timeline and the newest N of those
set aside. Besides those it keeps the checkpoints the guard may still go back to, and the versions whose evaluation is
still to come.
RUN/final.json names the checkpoint whose weights the run ended on."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_search.backends.megatron.checkpoint import (
    iteration_dir,
    latest_iteration,
    prune_iterations,
    rewind_to,
    saved_iterations,
)
from slime_search.utils.records import append_records, keep_records_before, read_records, write_records

LASTING_ACTIONS = ("rollback", "stop", "resume")  # guard events that survive a resume
HEALTH_CONFIG = "health_config.json"
UNDONE = "undone"
LAST_NUMBER = "last_number.txt"  # in checkpoints/undone/: the number of the newest set-aside folder, never lowered
PENDING = "pending.json"  # in checkpoints/undone/: a set-aside written down and not yet carried out
FINAL = "final.json"
STOPPED = "stopped.json"  # a stop's command, event and advice (RunFolder.record_stop; run.recovery.repeated_stop)
ROLLOUT_STATE = "rollout_state.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SetAside:
    """A rollback or a stop to the checkpoint of `steps_done`: the newer checkpoints (`moving`) go to
    checkpoints/undone/`name`."""

    steps_done: int
    name: str  # NNN-WHY
    moving: tuple[int, ...]


def aside_number(name: str) -> int:
    """The NNN of a set-aside folder NNN-WHY (0 for a name without one)."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.examples = self.path / "rollouts.jsonl"
        self.health = self.path / "health.jsonl"
        self.grades = self.path / "eval_grades.jsonl"  # per-question grades of each evaluation, for paired tests

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def hf_folder(self, steps_done: int) -> Path:
        """Where the HF copy of the checkpoint of `steps_done` steps goes (--save-hf)."""
        return self.path / "hf" / f"step_{steps_done}"

    def prune_hf_folders(self) -> list[int]:
        """Remove the HF copies whose checkpoint is gone (pruned by --keep-checkpoints, or a save cut short); the steps
        removed. Copies set aside with their checkpoints follow them (`set_aside`, `_prune_undone`)."""
        import shutil

        kept = set(self.checkpoint_steps())
        removed = []
        for folder in sorted((self.path / "hf").glob("step_*")):
            step = folder.name.removeprefix("step_")
            if folder.is_dir() and (not step.isdigit() or int(step) not in kept):  # a .partial or a pruned step
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(int(step) if step.isdigit() else -1)
        return removed

    def record_examples(self, step: int, kind: str, examples: list[dict]) -> None:
        append_records(self.examples, [{"step": step, "kind": kind, **example} for example in examples])

    def drop_examples_from(self, step: int) -> int:
        return keep_records_before(self.examples, step) + keep_records_before(self.grades, step)

    def record_grades(self, version: int, grades: list[float]) -> None:
        append_records(self.grades, [{"step": version, "grades": grades}])

    def eval_grades(self) -> dict[int, list[float]]:
        """Version -> the per-question grades of its evaluation (the guard's paired held-out tests replay them)."""
        return {record["step"]: record["grades"] for record in read_records(self.grades)}

    def record_health_config(self, config: Any) -> None:
        """The guard's bounds (a HealthConfig), for the report to draw beside the signals they bound."""
        import dataclasses

        (self.path / HEALTH_CONFIG).write_text(json.dumps(dataclasses.asdict(config), indent=1))

    def record_events(self, events: list[dict[str, Any]]) -> None:
        append_records(self.health, events)

    def events(self) -> list[dict[str, Any]]:
        return read_records(self.health)

    def record_resume(self, steps_done: int, attempt: int) -> None:
        """A run stopped by the guard and started again: its stop no longer ends it."""
        stops = [e for e in self.events() if e["action"] in ("stop", "resume")]
        if stops and stops[-1]["action"] == "stop":
            message = f"resumed after step {steps_done} (stopped before: {stops[-1]['message']})"
            event = {"step": steps_done, "action": "resume", "rule": "resume", "message": message, "values": {}}
            self.record_events([{**event, "attempt": attempt}])

    def rollback_steps(self) -> list[int]:
        """The step of every rollback done (a rollback decision is followed by the event of its completion, which
        names its target), in order."""
        return [e["step"] for e in self._rollbacks_done()]

    def rollback_targets(self) -> list[int]:
        """The checkpoint every rollback done went back to, in the order of `rollback_steps`."""
        return [int(e["values"]["to_step"]) for e in self._rollbacks_done()]

    def _rollbacks_done(self) -> list[dict]:
        return [e for e in self.events() if e["action"] == "rollback" and "to_step" in e.get("values", {})]

    def drop_events_from(self, step: int, attempt: int) -> int:
        """Forget the guard's warnings and skips of steps >= `step` made since the `attempt`-th rollback (a resumed
        run redoes those steps and decides anew); rollbacks, stops and what earlier attempts saw stay."""
        events = self.events()
        kept = [
            e for e in events if e["step"] < step or e["action"] in LASTING_ACTIONS or e.get("attempt", 0) != attempt
        ]
        if len(kept) != len(events):
            write_records(self.health, kept)
        return len(events) - len(kept)

    def prune_checkpoints(self, keep: int, protect: set[int] | tuple[int, ...] = ()) -> list[int]:
        """--keep-checkpoints: all but the newest `keep` checkpoints go, except `protect` (what the guard may still go
        back to), and all but the newest `keep` of those set aside; HF copies follow. Returns the steps removed."""
        removed = prune_iterations(self.checkpoints, keep, tuple(protect))
        removed_aside = self._prune_undone(keep)
        if removed:
            logger.info("removed the checkpoints of steps %s (--keep-checkpoints %d)", removed, keep)
        if removed_aside:
            logger.info(
                "removed %d checkpoints set aside by rollbacks and stops (--keep-checkpoints %d)", removed_aside, keep
            )
        self.prune_hf_folders()
        return removed

    def _prune_undone(self, keep: int) -> int:
        import shutil

        if keep <= 0:
            return 0
        aside = self.undone_checkpoints()  # oldest first
        for folder in aside[: max(0, len(aside) - keep)]:
            shutil.rmtree(folder)
            hf = self.path / "hf" / UNDONE / folder.parent.name / f"step_{int(folder.name.removeprefix('iter_'))}"
            shutil.rmtree(hf, ignore_errors=True)
        for root in (self.undone, self.path / "hf" / UNDONE):  # emptied sets go; their numbers are not reused
            for folder in root.glob("*"):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return max(0, len(aside) - keep)

    def checkpoint_steps(self) -> list[int]:
        """The steps done at every complete checkpoint still in the folder."""
        return saved_iterations(self.checkpoints)

    @property
    def undone(self) -> Path:
        return self.checkpoints / UNDONE

    def plan_set_aside(self, steps_done: int, why: str) -> SetAside:
        """What making the checkpoint of `steps_done` the one a resume starts from would set aside, and where: a folder
        whose number is taken now (written before anything moves, so no later set reuses it)."""
        if steps_done not in self.checkpoint_steps():
            raise FileNotFoundError(f"no checkpoint of step {steps_done} in {self.checkpoints}")
        number = self._last_aside_number() + 1
        self.undone.mkdir(parents=True, exist_ok=True)
        write_atomically(self.undone / LAST_NUMBER, f"{number}\n")
        moving = tuple(k for k in self.checkpoint_steps() if k > steps_done)
        return SetAside(steps_done, f"{number:03d}-{why}", moving)

    def _last_aside_number(self) -> int:
        counter = self.undone / LAST_NUMBER
        numbers = [int(counter.read_text()) if counter.is_file() else 0]
        for root in (self.undone, self.path / "hf" / UNDONE):
            numbers += [aside_number(folder.name) for folder in root.glob("*") if folder.is_dir()]
        return max(numbers)

    def carry_out(self, plan: SetAside, event: dict[str, Any] | None = None) -> Path | None:
        """Set aside as `plan` says. Returns the folder the checkpoints went to, if any.

        The set-aside is first written down with `event` (the guard's record of the rollback or stop). Then the event
        is recorded, then the tracker rewound and the checkpoints and HF copies moved. A crash at any point leaves what
        `finish_set_aside` completes on resume."""
        intent = {"steps_done": plan.steps_done, "name": plan.name, "moving": list(plan.moving), "event": event}
        write_atomically(self.undone / PENDING, json.dumps(intent))
        self.finish_set_aside()
        return self.undone / plan.name if plan.moving else None

    def finish_set_aside(self) -> SetAside | None:
        """Complete the set-aside written down and cut short by a crash, if any (a resumed run calls it first); each
        part is done only if it was not: the event is recorded once, a checkpoint already moved is not moved again."""
        pending = self.undone / PENDING
        if not pending.is_file():
            return None
        intent = json.loads(pending.read_text())
        plan = SetAside(intent["steps_done"], intent["name"], tuple(intent["moving"]))
        event = intent.get("event")
        if event is not None and event not in self.events():
            self.record_events([event])
        rewind_to(self.checkpoints, plan.steps_done, self.undone / plan.name)
        for step in plan.moving:
            hf = self.hf_folder(step)
            if hf.is_dir():
                (self.path / "hf" / UNDONE / plan.name).mkdir(parents=True, exist_ok=True)
                hf.rename(self.path / "hf" / UNDONE / plan.name / hf.name)
        pending.unlink()
        return plan

    def set_aside(
        self, steps_done: int, why: str, event: dict[str, Any] | None = None
    ) -> tuple[list[int], Path | None]:
        """The checkpoint of `steps_done` becomes the one a resume starts from; the newer ones (and their HF copies)
        move to checkpoints/undone/NNN-WHY/. Returns the steps moved and where they went."""
        plan = self.plan_set_aside(steps_done, why)
        return list(plan.moving), self.carry_out(plan, event)

    def undone_checkpoints(self) -> list[Path]:
        """The checkpoints set aside by rollbacks and stops, oldest first (by set, then by step)."""
        found = [p for p in self.undone.glob("*/iter_*") if p.is_dir()]
        return sorted(found, key=lambda p: (aside_number(p.parent.name), p.parent.name, p.name))

    def record_final(self, steps_done: int | None, reason: str, hf: bool, at_step: int | None = None) -> dict[str, Any]:
        """RUN/final.json: the checkpoint whose weights the run ended on, and why (also when it is not the last). With
        no checkpoint to end on (`steps_done` None, a stop before the first save) it names the step `at_step` whose
        weights, never saved, the run ended with."""
        if steps_done is None:
            final = {"step": at_step, "checkpoint": None, "hf": None, "reason": f"{reason}; no checkpoint holds them"}
        else:
            final = {
                "step": steps_done,
                "checkpoint": str(iteration_dir(self.checkpoints, steps_done).relative_to(self.path)),
                "hf": str(self.hf_folder(steps_done).relative_to(self.path)) if hf else None,
                "reason": reason,
            }
        write_atomically(self.path / FINAL, json.dumps(final, indent=1) + "\n")
        return final

    def record_stop(self, argv: list[str], event: dict[str, Any], advice: str, transient: bool = False) -> None:
        """What a stop needs to be told apart from a crash when the same command runs again (RUN/stopped.json);
        `transient`: a stop of a fault that passes, which the same command may resume."""
        stopped = {"argv": argv, "event": event, "advice": advice, "transient": transient}
        (self.path / STOPPED).write_text(json.dumps(stopped, indent=1))

    def latest_checkpoint(self) -> int | None:
        """The steps done at the last complete checkpoint (its tracker file is written last), or None."""
        return latest_iteration(self.checkpoints)

    @staticmethod
    def rollout_state_file(steps_done: int, state: dict[str, Any]) -> dict[str, str]:
        """The rollout state as a file of the actor's checkpoint (written with it, so both are there or neither)."""
        return {ROLLOUT_STATE: json.dumps({"steps_done": steps_done, **state})}

    def rollout_state(self, steps_done: int) -> dict[str, Any]:
        return json.loads((iteration_dir(self.checkpoints, steps_done) / ROLLOUT_STATE).read_text())
