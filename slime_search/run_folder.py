"""What a training run keeps in its folder besides the metrics (metrics.jsonl, slime_search.metrics): the rollouts
shown in the report (rollouts.jsonl), the health guard's events (health.jsonl) and, per checkpoint, the rollout state
(the data position) next to the actor's torch_dist files (checkpoints/iter_N/, written with them). A resumed run drops
what was recorded after its last complete checkpoint, except the rollbacks and stops of the guard: they changed the
run's course (a rollback's remedy holds for the rest of the run) and stay in its history."""

from __future__ import annotations

import json
import logging
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

ROLLOUT_STATE = "rollout_state.json"
logger = logging.getLogger(__name__)


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.examples = self.path / "rollouts.jsonl"
        self.health = self.path / "health.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def hf_folder(self, steps_done: int) -> Path:
        """Where the HF copy of the checkpoint of `steps_done` steps goes (--save-hf)."""
        return self.path / "hf" / f"step_{steps_done}"

    def prune_hf_folders(self) -> list[int]:
        """Remove the HF copies whose checkpoint is gone (pruned, or dropped by a rollback); the steps removed."""
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
        return keep_records_before(self.examples, step)

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

    def rollback_count(self) -> int:
        """Rollbacks done (a rollback decision is followed by the event of its completion, which names its target)."""
        return sum(e["action"] == "rollback" and "to_step" in e.get("values", {}) for e in self.events())

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

    def prune_checkpoints(self, keep: int, protect: tuple[int, ...] = ()) -> None:
        removed = prune_iterations(self.checkpoints, keep, protect)
        if removed:
            logger.info("removed checkpoints of steps %s (--keep-checkpoints %d)", removed, keep)

    def checkpoint_steps(self) -> list[int]:
        """The steps done at every complete checkpoint still in the folder."""
        return saved_iterations(self.checkpoints)

    def rewind_checkpoints(self, steps_done: int) -> list[int]:
        """The checkpoint of `steps_done` becomes the one a resume starts from; newer ones are removed."""
        return rewind_to(self.checkpoints, steps_done)

    def latest_checkpoint(self) -> int | None:
        """The steps done at the last complete checkpoint (its tracker file is written last), or None."""
        return latest_iteration(self.checkpoints)

    @staticmethod
    def rollout_state_file(steps_done: int, state: dict[str, Any]) -> dict[str, str]:
        """The rollout state as a file of the actor's checkpoint (written with it, so both are there or neither)."""
        return {ROLLOUT_STATE: json.dumps({"steps_done": steps_done, **state})}

    def rollout_state(self, steps_done: int) -> dict[str, Any]:
        return json.loads((iteration_dir(self.checkpoints, steps_done) / ROLLOUT_STATE).read_text())
