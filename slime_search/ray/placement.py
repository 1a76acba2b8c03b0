"""The RolloutManager actor from the driver's side: where it runs, and so where its engines run (on GPUs of their own,
which Ray gives to the manager and keeps apart from the actor's; on the actor's GPUs with --colocate; or the CPU
engine on a CPU machine), and stopping it."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def create_rollout_manager(config, plugin_args, group, colocate: bool):
    """The RolloutManager actor (`config`: a RolloutManagerConfig), which starts the engines. Colocated engines take
    the actor's GPUs in rank order, so engine e's TP rank i sits on trainer rank e*k+i's device."""
    import ray

    from slime_search.rollout.manager import RolloutManager

    on_gpu = group.config.use_gpu
    rollout_gpus = config.engines.num_gpus if on_gpu and not colocate else 0
    gpu_ids = group.gpu_ids() if on_gpu and colocate else None
    options = {"num_cpus": 0, "num_gpus": rollout_gpus, "max_concurrency": 4}
    return ray.remote(RolloutManager).options(**options).remote(config, plugin_args, gpu_ids)


def create_eval_manager(config, plugin_args, group):
    """--eval-engine: a second RolloutManager whose one engine only evaluates. On GPU it needs GPUs no one else
    holds; without them the run stops here with a message, not in an endless wait for Ray to place it."""
    import ray

    from slime_search.rollout.manager import RolloutManager

    gpus = config.engines.num_gpus if group.config.use_gpu and not config.engines.engine_url else 0
    if gpus and ray.available_resources().get("GPU", 0) < gpus:
        raise RuntimeError(
            f"--eval-engine needs {gpus} GPU(s) beside the actor's and the rollout engines'; Ray has "
            f"{ray.available_resources().get('GPU', 0):g} free (give a spare GPU, or use --eval-engine-url)"
        )
    options = {"num_cpus": 0, "num_gpus": gpus, "max_concurrency": 2}
    return ray.remote(RolloutManager).options(**options).remote(config, plugin_args, None)


def stop_rollout_manager(manager) -> None:
    """Stop the engines the manager started, then the actor itself (also when its start-up failed)."""
    import ray

    try:
        ray.get(manager.shutdown.remote(), timeout=60)
    except Exception as err:  # noqa: BLE001 - a manager that failed to start has nothing to stop
        logger.warning("rollout manager shutdown: %s", err)
    ray.kill(manager)
