"""The parts of a training run, in one object: what the driver, the recovery and the evaluators all reach.

`start_parts` brings them up in the order that overlaps the slow starts (engines load while the actor loads; colocated
engines start once the actor has made room), `shut_down` takes them down in reverse; the engine-pool policy between
steps (restart engines that died, let them rejoin at the next push) lives here too, since it touches the manager, the
transport and the schedule together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from slime_search.utils.clock import SystemClock

logger = logging.getLogger(__name__)


@dataclass
class RunHandles:
    config: Any  # RunConfig, built once from the flags
    run: Any  # RunFolder
    sink: Any  # MetricsSink
    group: Any  # RayTrainGroup: the Megatron actor's ranks
    guard: Any  # HealthGuard
    manager: Any = None  # the RolloutManager actor: engines, prompt data, plugins
    transport: Any = None  # the weight transport to the engines (None in SFT: the engine is a demonstrator)
    colocation: Any = None  # Colocation: the memory hand-over when engines share the actor's GPUs
    evaluator: Any = None  # InStepEval or BesideEval (slime_search.evaluators)
    rollouts: Any = None  # the rollout schedule (--async-mode), made anew by a rollback
    clock: Any = field(default_factory=SystemClock)  # now() and sleep(s): the waits of passing faults (health.pauses)
    checkpoint_bytes: int | None = None  # the size of one checkpoint of the actor (disk_budget), once it is built

    def start_rollouts(self, step: int) -> None:
        from slime_search.health.remedy import remedied_schedule
        from slime_search.rollout.schedule import create_schedule

        self.rollouts = create_schedule(remedied_schedule(self.config.schedule, self.guard.rollbacks), self.manager)
        self.rollouts.start(step)

    def save(self, steps_done: int) -> None:
        """The actor (model, optimizer, RNG) and the rollout state in one folder renamed into place when complete, the
        tracker file last; with --save-hf an HF folder too, streamed shard by shard. Then --keep-checkpoints prunes,
        keeping every checkpoint the guard could still go back to (RollbackPolicy.needed) and those of the versions
        whose evaluation is still to come (beside training it can take longer than several save intervals). A --save
        disk without room for it raises OSError ENOSPC (or EDQUOT) with the earlier checkpoints and the tracker as they
        were; health.pauses.save_checkpoint waits that out."""
        import ray

        h, config, run = self, self.config, self.run
        h.check_room()
        h.colocation.for_weight_push()  # the actor's state must be on its device
        h.group.save(
            str(run.checkpoints), steps_done, run.rollout_state_file(steps_done, ray.get(h.manager.state_dict.remote()))
        )
        if config.save_hf:
            sync = config.weight_sync
            h.group.on_all_ranks(
                "write_hf_streamed", sync.hf_checkpoint, str(run.hf_folder(steps_done)), sync.bucket_bytes
            )
        if steps_done == 0 and config.colocate and h.transport is not None:  # colocated engines gave their weights up
            h.transport.push("0")
        kept = run.checkpoint_steps()
        evaluating = h.evaluator.pending_versions() if h.evaluator is not None else set()
        run.prune_checkpoints(config.keep_checkpoints, h.guard.checkpoints_needed(kept) | evaluating)

    def check_room(self) -> None:
        """OSError ENOSPC before a save that the --save disk has no room for (one checkpoint's size, disk_budget): the
        ranks are not sent into a save that would fail on one of them before they agree on anything."""
        import errno
        import shutil

        path = self.run.path
        if self.checkpoint_bytes is None or not path.exists():
            return
        free = shutil.disk_usage(path).free
        if free < self.checkpoint_bytes:
            raise OSError(
                errno.ENOSPC, f"No space left on device for a checkpoint of {self.checkpoint_bytes / 1e9:.1f} GB"
            )

    def restart_down_engines(self) -> list[str]:
        """After a rollout: engines that died or stopped answering start again, while the actor trains. Colocated
        engines are not restarted (one would take GPU memory the actor holds): the next push to a dead one fails the
        run, which then resumes from its last checkpoint."""
        import ray

        if self.config.colocate:
            return []
        return ray.get(self.manager.restart_down_engines.remote())

    def engines_back(self) -> list[str]:
        """Before the push: wait for the restarted engines and pause them, so that no trajectory reaches one before it
        holds the current weights; they take the push with the others and continue after it."""
        import ray

        back = ray.get(self.manager.wait_restarted_engines.remote())
        if back:
            ray.get(self.manager.pause_generation.remote(back))
            if self.transport is not None:
                self.transport.reconnect()
            logger.warning("engines %s are back; they take the next weight push", back)
        return back

    def shut_down(self) -> None:
        """Engines leave the weight-update group, then the managers stop them; the actor and the sink close last."""
        from slime_search.ray.placement import stop_rollout_manager

        if self.transport is not None:
            try:
                self.transport.close()
            except Exception as err:  # noqa: BLE001 - a failed run still stops its engines and actors
                logger.warning("closing the weight transport: %s", err)
        for rollout_side in (self.manager, getattr(self.evaluator, "manager", None)):
            if rollout_side is not None:
                stop_rollout_manager(rollout_side)
        self.group.shutdown()
        self.sink.close()


def open_run(config, args) -> RunHandles:
    """The run folder, its metrics sink, Ray (the actors' warnings reach this console: Ray forwards their stderr), the
    actor's group (not started yet) and the health guard."""
    import ray

    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.ray.session import RECORD_NAME, init_address, record_started_processes
    from slime_search.ray.train_group import RayTrainGroup
    from slime_search.run_folder import RunFolder

    run = RunFolder(config.run_dir)
    run.record_health_config(config.health)
    sink = MetricsSink(run.path, *config.wandb, config=vars(args))
    if not ray.is_initialized():
        ray.init(address=init_address(), include_dashboard=False, log_to_driver=True, configure_logging=False)
    record_started_processes(run.path / RECORD_NAME)  # what a SIGKILLed driver leaves, for the run scripts to stop
    guard = HealthGuard(config.health, config.rollout.rollout.reward_key)
    return RunHandles(config, run, sink, RayTrainGroup(config.train_group), guard)


def start_parts(h: RunHandles, args) -> None:
    """Engines, evaluator, actor and transport of the run, filled into `h` as each starts (so that `shut_down` stops
    what did start when a later one fails)."""
    import ray

    from slime_search.disk_budget import check_disk_budget
    from slime_search.evaluators import BesideEval, InStepEval
    from slime_search.ray.colocation import Colocation
    from slime_search.ray.placement import create_rollout_manager
    from slime_search.ray.session import RECORD_NAME, record_started_processes
    from slime_search.weight_sync.transports import create_transport

    config = h.config
    if not config.colocate:  # the engines start while the actor loads
        h.manager = create_rollout_manager(config.rollout, args, h.group, colocate=False)
    h.evaluator = BesideEval.start(h, args) if config.eval_engine is not None else InStepEval(h)
    logger.info("%s", h.group.load_models(config.model, config.actor))
    # refuses a run whose --save disk is too small; a save that later finds it full says how much one needs
    h.checkpoint_bytes = check_disk_budget(config, h.group.checkpoint_layout(), h.run).per_checkpoint
    h.colocation = Colocation(config.colocate, h.group, h.manager)
    if config.colocate:  # the engines start on the actor's GPUs once the actor has made room
        h.colocation.for_generation()
        h.manager = h.colocation.manager = create_rollout_manager(config.rollout, args, h.group, colocate=True)
    if config.serves_policy:  # in SFT the samples come from another engine, which takes no weights
        h.transport = create_transport(config.weight_sync, h.group, ray.get(h.manager.worker_urls.remote()))
        h.transport.connect()
    record_started_processes(h.run.path / RECORD_NAME)  # the engines, the actor's workers and Ray's agents are up
