"""What a training run keeps in its folder besides the metrics (metrics.jsonl, slime_search.metrics): the rollouts
shown in the report (rollouts.jsonl) and, per checkpoint, the rollout state (the data position) next to the actor's
torch_dist files (checkpoints/iter_N/, written with them). A resumed run drops what was recorded after its last
complete checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from slime_search.backends.megatron.checkpoint import iteration_dir, latest_iteration, prune_iterations
from slime_search.utils.records import append_records, keep_records_before

ROLLOUT_STATE = "rollout_state.json"
logger = logging.getLogger(__name__)


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.examples = self.path / "rollouts.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def record_examples(self, step: int, kind: str, examples: list[dict]) -> None:
        append_records(self.examples, [{"step": step, "kind": kind, **example} for example in examples])

    def drop_examples_from(self, step: int) -> int:
        return keep_records_before(self.examples, step)

    def prune_checkpoints(self, keep: int) -> None:
        removed = prune_iterations(self.checkpoints, keep)
        if removed:
            logger.info("removed checkpoints of steps %s (--keep-checkpoints %d)", removed, keep)

    def latest_checkpoint(self) -> int | None:
        """The steps done at the last complete checkpoint (its tracker file is written last), or None."""
        return latest_iteration(self.checkpoints)

    @staticmethod
    def rollout_state_file(steps_done: int, state: dict[str, Any]) -> dict[str, str]:
        """The rollout state as a file of the actor's checkpoint (written with it, so both are there or neither)."""
        return {ROLLOUT_STATE: json.dumps({"steps_done": steps_done, **state})}

    def rollout_state(self, steps_done: int) -> dict[str, Any]:
        return json.loads((iteration_dir(self.checkpoints, steps_done) / ROLLOUT_STATE).read_text())
