"""torch_dist checkpoints (Megatron's distributed checkpoint format) of the model: save, load, resharding.

A checkpoint directory holds `iter_XXXXXXX/` folders and `latest_checkpointed_iteration.txt`, as Megatron and
slime lay them out. torch_dist stores each tensor with its global shape, so a checkpoint saved at one
tensor-parallel size loads at another. The tracker file is written last, after the iteration folder is
complete, so a crash mid-save never makes a half-written checkpoint the latest one.
"""

from __future__ import annotations

import os
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return 0 if text == "release" else int(text)


def save_model(model, root: str | Path, iteration: int) -> Path:
    """Collective: every rank calls it. Returns the iteration folder."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = Path(root) / (TRACKER + ".tmp")
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(root) / TRACKER)
    dist.barrier()
    return target


def load_model(model, root: str | Path, iteration: int | None = None) -> int:
    """Collective: load the given (default: latest) iteration into `model`; returns the iteration loaded."""
    from megatron.core import dist_checkpointing

    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(f"no {TRACKER} in {root}: not a torch_dist checkpoint directory")
    folder = iteration_dir(root, iteration)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    state = dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(folder))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(
            f"checkpoint {folder} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return iteration


def _optimizer_file(root: str | Path, iteration: int) -> Path:
    import torch.distributed as dist

    return iteration_dir(root, iteration) / f"optimizer_rank{dist.get_rank():05d}.pt"


def _rng_file(root: str | Path, iteration: int) -> Path:
    import torch.distributed as dist

    return iteration_dir(root, iteration) / f"rng_rank{dist.get_rank():05d}.pt"


def rng_state() -> dict:
    """This process's random states (python, numpy, torch CPU and CUDA), to continue a run bit for bit."""
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_actor(actor, root: str | Path, iteration: int) -> Path:
    """Model (torch_dist, reshardable), optimizer state and RNG state (per rank, same parallel layout to resume).

    The optimizer and RNG files are written before the model and the tracker, so the tracker only ever names a
    complete iteration.
    """
    import torch
    import torch.distributed as dist

    folder = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if hasattr(actor.optimizer, "state_dict"):
        torch.save(actor.optimizer.state_dict(), _optimizer_file(root, iteration))
    torch.save(rng_state(), _rng_file(root, iteration))
    return save_model(actor.model.module, root, iteration)


def load_actor(actor, root: str | Path, iteration: int | None = None, load_optimizer: bool = True) -> int:
    import torch

    iteration = load_model(actor.model.module, root, iteration)
    path = _optimizer_file(root, iteration)
    if load_optimizer and hasattr(actor.optimizer, "load_state_dict"):
        if not path.is_file():
            raise FileNotFoundError(f"no optimizer state {path}: resume needs the parallel layout it was saved with")
        actor.optimizer.load_state_dict(torch.load(path, weights_only=False))
    if load_optimizer and _rng_file(root, iteration).is_file():
        set_rng_state(torch.load(_rng_file(root, iteration), weights_only=False))
    return iteration
