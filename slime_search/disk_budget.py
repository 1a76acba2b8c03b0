"""The disk a run's checkpoints can take at once, checked against the free space of the --save disk at start.

One checkpoint is `checkpoint_bytes` of the actor as built (`slime_search.backends.megatron.checkpoint_size`). How
many can be on disk at once, with --keep-checkpoints N > 0 (`RunFolder.prune_checkpoints` after every save):
- the newest N of the run, and the one being written (a save completes before pruning removes the oldest);
- with the health guard on, those it may still go back to, stop on or end on (`RollbackPolicy.needed`). They are the
  starting weights, the last healthy one and the best evaluated one. For each rollback still within
  --health-rollback-window they include the checkpoint before its target, as a new rollback passes over that target.
  So they number 3 + --max-rollbacks. Beside them are the newest N that rollbacks and stops set aside in
  checkpoints/undone/ (`RunFolder._prune_undone`);
- with evaluation beside training (--eval-engine), the 2 versions being evaluated and waiting to be
  (`BesideEval.pending_versions`).
That is 2N + 4 + R with the guard, where R is --max-rollbacks: 10 for the defaults N = 2, R = 2. It is N + 1 without the
guard. With --eval-engine there are 2 more. The peaks the recipe-shaped weeks of `benchmarks.studies.guard_week` reached
are in docs/benchmarks/health.md. With N = 0 every checkpoint stays: as many as the run saves (more when a rollback
redoes steps). HF copies (--save-hf) come on top.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GUARD_PROTECTED = 3  # the starting weights, the last healthy checkpoint, the best evaluated one (+ one per rollback)
EVALUATING = 2  # with --eval-engine: the version being evaluated and the one waiting for it


class NotEnoughDisk(RuntimeError):
    """The --save disk cannot hold the checkpoints the run will keep."""


def checkpoints_at_once(
    keep: int, guard: bool, saves: int, evaluating_beside: bool = False, max_rollbacks: int = 2
) -> int:
    """The most checkpoints on disk at once: see the module's docstring. `saves`: how many the run saves."""
    if keep <= 0:
        return saves
    guarded = GUARD_PROTECTED + max_rollbacks + keep
    protected = (guarded if guard else 0) + (EVALUATING if evaluating_beside else 0)
    return keep + 1 + protected


def saves_in_run(config) -> int:
    """The checkpoints a run of `config` (a RunConfig) saves from its start: the starting weights with the guard on and
    --save-interval set (run.loop.run_steps), then every step `save_due` names."""
    first = 1 if config.health.enabled and config.save_interval else 0
    return first + sum(config.save_due(step) for step in range(1, config.num_rollout + 1))


@dataclass(frozen=True)
class DiskBudget:
    per_checkpoint: int  # bytes
    count: int  # the most checkpoints on disk at once
    on_disk: int  # checkpoints of the run already there (a resumed run)
    free: int  # bytes free on the --save disk

    @property
    def total(self) -> int:
        return self.per_checkpoint * self.count

    @property
    def needed(self) -> int:
        """Bytes still to find: the checkpoints already on disk take their share of the budget, and the next save needs
        room for one more before pruning makes room."""
        return self.per_checkpoint * max(1, self.count - self.on_disk)

    @property
    def fits(self) -> bool:
        return self.needed <= self.free


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def refusal(budget: DiskBudget, save: str, keep: int) -> str:
    """What a run whose budget does not fit is told: what it needs, what there is, and what to change."""
    kept = f"--keep-checkpoints {keep}" if keep > 0 else "--keep-checkpoints 0 (every checkpoint kept)"
    return (
        f"the checkpoints of this run need {gigabytes(budget.needed)} more on the disk of --save {save} "
        f"({budget.count} on disk at once with {kept}, {gigabytes(budget.per_checkpoint)} each, {budget.on_disk} "
        f"there already), and it has {gigabytes(budget.free)} free: free space there, give --save a folder on a "
        f"larger disk, or keep fewer checkpoints with a lower --keep-checkpoints N (2N + 4 + --max-rollbacks are on "
        f"disk at once with the health guard, N + 1 without, 2 more with --eval-engine)"
    )


def disk_budget(config, layout, run) -> DiskBudget:
    """The budget of a run of `config` (RunConfig) whose actor has `layout` (CheckpointLayout), in run folder `run`."""
    from slime_search.backends.megatron.checkpoint_size import checkpoint_bytes

    guard, beside = config.health.enabled, config.eval_engine is not None
    count = checkpoints_at_once(
        config.keep_checkpoints, guard, saves_in_run(config), beside, config.health.max_rollbacks
    )
    on_disk = len(run.checkpoint_steps()) + len(run.undone_checkpoints())
    return DiskBudget(checkpoint_bytes(layout), count, on_disk, shutil.disk_usage(run.path).free)


def check_disk_budget(config, layout, run) -> DiskBudget:
    """Log the budget (one line) and refuse to start a run whose checkpoints the --save disk cannot hold."""
    budget = disk_budget(config, layout, run)
    logger.info(
        "checkpoints: %s each (model %s, optimizer %s over %d tensor-parallel slices), up to %d on disk at once "
        "(--keep-checkpoints %d), %s in all, %d there already; free on the --save disk: %s",
        gigabytes(budget.per_checkpoint),
        gigabytes(layout.model_bytes()),
        gigabytes(layout.optimizer_bytes()),
        len(layout.slice_parameters),
        budget.count,
        config.keep_checkpoints,
        gigabytes(budget.total),
        budget.on_disk,
        gigabytes(budget.free),
    )
    if not budget.fits:
        raise NotEnoughDisk(refusal(budget, config.run_dir, config.keep_checkpoints))
    return budget
