"""The parts of a training run, typed (run.protocols), and how they start and stop.

`open_parts` brings them up in the order that overlaps the slow starts (engines load while the actor loads; colocated
engines start once the actor has made room), each registered on one ExitStack as it starts: leaving the stack stops
what did start, in reverse, also when a later part failed to start. The engine-pool policy between steps (restart
engines that died, let them rejoin at the next push) lives here too, since it touches the manager, the transport and
the schedule together.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slime_search.utils.clock import SystemClock

if TYPE_CHECKING:
    import argparse

    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.run.config import RunConfig
    from slime_search.run.eval_engine import EvalEngine
    from slime_search.run.folder import RunFolder
    from slime_search.run.protocols import (
        Clock,
        Evaluator,
        RemoteManager,
        RolloutSchedule,
        TrainGroup,
        WeightPush,
    )

logger = logging.getLogger(__name__)


@dataclass
class RunParts:
    config: RunConfig  # built once from the flags
    folder: RunFolder  # RUN/: checkpoints, records, the events of the guard
    sink: MetricsSink  # every step's record
    group: TrainGroup  # the Megatron actor's ranks
    guard: HealthGuard
    manager: RemoteManager  # the RolloutManager actor: engines, prompt data, plugins
    transport: WeightPush | None  # the weights to the engines (None in SFT: the engine is a demonstrator)
    colocation: Colocation  # the memory hand-over when engines share the actor's GPUs
    evaluator: Evaluator  # inside the step or beside training (run.evaluators)
    schedule: RolloutSchedule  # the rollouts, by --async-mode; made anew when the run (re)starts from a step (`start_rollouts`)
    clock: Clock = field(default_factory=SystemClock)  # the waits of passing faults (run.pauses)
    checkpoint_bytes: int | None = None  # the size of one checkpoint of the actor (disk_budget)

    def start_rollouts(self, step: int) -> None:
        """The schedule of --async-mode, with the remedy of the recent rollbacks, started on the weights of `step`."""
        from slime_search.health.remedy import remedied_schedule
        from slime_search.rollout.schedule import create_schedule

        self.schedule = create_schedule(remedied_schedule(self.config.schedule, self.guard.rollbacks), self.manager)
        self.schedule.start(step)

    def first_checkpoint_due(self, step: int) -> bool:
        """Whether a guarded run starting from step 0 with no checkpoint saves one first: the rollback target before a
        later checkpoint proves healthy."""
        config = self.config
        return (
            step == 0
            and config.health.enabled
            and bool(config.save_interval)
            and self.folder.latest_checkpoint() is None
        )

    def save(self, steps_done: int) -> None:
        """The actor (model, optimizer, RNG) and the rollout state in one folder renamed into place when complete, the
        tracker file last; with --save-hf an HF folder too, streamed shard by shard. Then --keep-checkpoints prunes.
        It keeps every checkpoint the guard could still go back to (RollbackPolicy.needed), and those of the versions
        whose evaluation is still to come. Beside training, an evaluation can take longer than several save
        intervals. A --save
        disk without room for it raises OSError ENOSPC (or EDQUOT) with the earlier checkpoints and the tracker as they
        were; run.pauses.save_checkpoint waits that out."""
        import ray

        config, run = self.config, self.folder
        self.check_room()
        self.colocation.for_weight_push()  # the actor's state must be on its device
        self.group.save(
            str(run.checkpoints),
            steps_done,
            run.rollout_state_file(steps_done, ray.get(self.manager.state_dict.remote())),
        )
        if config.save_hf:
            sync = config.weight_sync
            self.group.on_all_ranks(
                "write_hf_streamed", sync.hf_checkpoint, str(run.hf_folder(steps_done)), sync.bucket_bytes
            )
        if steps_done == 0 and config.colocate and self.transport is not None:  # colocated engines gave theirs up
            self.transport.push("0")
        kept = run.checkpoint_steps()
        evaluating = self.evaluator.pending_versions()
        run.prune_checkpoints(config.keep_checkpoints, self.guard.checkpoints_needed(kept) | evaluating)

    def check_room(self) -> None:
        """OSError ENOSPC before a save that the --save disk has no room for (one checkpoint's size, disk_budget).

        So the ranks are not sent into a save that would fail on one of them before they agree on anything."""
        import errno
        import shutil

        path = self.folder.path
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


def open_parts(config: RunConfig, args: argparse.Namespace, stack: ExitStack) -> RunParts:
    """The run folder, its metrics sink, Ray (the actors' warnings reach this console: Ray forwards their stderr), the
    actor's group, the engines, the evaluator and the weight transport, each stopped by `stack` once started."""
    import ray

    from slime_search.disk_budget import check_disk_budget
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.ray.session import RECORD_NAME, init_address, record_started_processes
    from slime_search.ray.train_group import RayTrainGroup
    from slime_search.rollout.schedule import create_schedule
    from slime_search.run.folder import RunFolder

    folder = RunFolder(config.run_dir)
    folder.record_health_config(config.health)
    sink = MetricsSink(folder.path, *config.wandb, config=vars(args))
    stack.callback(sink.close)
    if not ray.is_initialized():
        ray.init(address=init_address(), include_dashboard=False, log_to_driver=True, configure_logging=False)
    record_started_processes(folder.path / RECORD_NAME)  # what a SIGKILLed driver leaves, for the run scripts to stop
    group = RayTrainGroup(config.train_group)
    stack.callback(group.shutdown)
    manager = None if config.colocate else start_manager(config, args, group, stack)  # loads while the actor does
    beside = start_beside(config, args, group, folder, stack) if config.eval_engine is not None else None
    logger.info("%s", group.load_models(config.model, config.actor))
    # refuses a run whose --save disk is too small; a save that later finds it full says how much one needs
    checkpoint_bytes = check_disk_budget(config, group.checkpoint_layout(), folder).per_checkpoint
    colocation = Colocation(
        config.colocate, group, manager, keep_engine_weights=config.weight_sync.served_adapter is not None
    )
    if config.colocate:  # the engines start on the actor's GPUs once the actor has made room
        colocation.for_generation()
        manager = colocation.manager = start_manager(config, args, group, stack)
    transport = start_transport(config, group, manager, stack) if config.serves_policy else None
    record_started_processes(folder.path / RECORD_NAME)  # the engines, the actor's workers and Ray's agents are up
    return RunParts(
        config, folder, sink, group, HealthGuard(config.health, config.rollout.rollout.reward_key), manager, transport,
        colocation, evaluator(config, manager, colocation, beside), create_schedule(config.schedule, manager),
        checkpoint_bytes=checkpoint_bytes,
    )  # fmt: skip


def start_manager(config: RunConfig, args: argparse.Namespace, group: TrainGroup, stack: ExitStack) -> RemoteManager:
    """The RolloutManager actor, which starts the engines; stopped (engines first) when the stack closes."""
    from slime_search.ray.placement import create_rollout_manager, stop_rollout_manager

    manager = create_rollout_manager(config.rollout, args, group, colocate=config.colocate)
    stack.callback(stop_rollout_manager, manager)
    return manager


def start_beside(
    config: RunConfig, args: argparse.Namespace, group: TrainGroup, folder: RunFolder, stack: ExitStack
) -> EvalEngine:
    """--eval-engine: the evaluator's RolloutManager with its engine, started now (it loads while the actor does); a
    failed one is replaced by a new one, and the one in place when the stack closes is stopped."""
    from slime_search.ray.placement import create_eval_manager, stop_rollout_manager
    from slime_search.run.eval_engine import EvalEngine
    from slime_search.run.evaluators import eval_deadline

    def new_evaluator():
        return create_eval_manager(config.eval_engine, args, group)

    deadline_s, questions = eval_deadline(config)
    logger.info("evaluation beside training: %d questions, each evaluation within %.0f s", questions, deadline_s)
    beside = EvalEngine(new_evaluator(), group, folder.path, config.weight_sync, config.log_rollout_examples,
                        timeout_s=deadline_s, restart=new_evaluator)  # fmt: skip
    stack.callback(lambda: stop_rollout_manager(beside.evaluator))
    return beside


def start_transport(config: RunConfig, group: TrainGroup, manager: RemoteManager, stack: ExitStack) -> WeightPush:
    """The weight transport to the engines, connected; closed first when the stack closes (the engines leave the
    weight-update group before their managers stop them)."""
    import ray

    from slime_search.weight_sync.transports import create_transport

    transport = create_transport(config.weight_sync, group, ray.get(manager.worker_urls.remote()))
    stack.callback(close_transport, transport)
    transport.connect()
    return transport


def close_transport(transport: WeightPush) -> None:
    try:
        transport.close()
    except Exception as err:  # noqa: BLE001 - a failed run still stops its engines and actors
        logger.warning("closing the weight transport: %s", err)


def evaluator(
    config: RunConfig, manager: RemoteManager, colocation: Colocation, beside: EvalEngine | None
) -> Evaluator:
    """Held-out evaluation beside training (--eval-engine) or inside the step."""
    from slime_search.run.evaluators import BesideEval, InStepEval

    return BesideEval(config, colocation, beside) if beside is not None else InStepEval(config, manager)
