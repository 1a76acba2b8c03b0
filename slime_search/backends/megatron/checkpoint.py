"""torch_dist checkpoints (Megatron's distributed checkpoint format) of the model: save, load, resharding.

A checkpoint directory holds `iter_XXXXXXX/` folders and `latest_checkpointed_iteration.txt`, as Megatron and slime lay
them out. torch_dist stores each tensor with its global shape, so a checkpoint saved at one tensor-parallel size loads
at another. A save writes everything into `iter_XXXXXXX.partial/`, the model first, into an empty folder, as Megatron's
saver expects. It renames the folder into place and writes the tracker file last. So a crash mid-save leaves at most a
partial folder, which the next save replaces and no load ever reads; a save that fails on any rank (a --save disk that
is full: ENOSPC, EDQUOT) fails on every rank. It fails after the partial folder is removed, with the earlier checkpoints
and the tracker as they were. No rank is left waiting in a collective the others never reach (`_write_all`). Beside the
model, an actor's checkpoint holds the optimizer state once per tensor-parallel slice (`optimizer_tpNN.pt`) and each
rank's RNG state (`rng_rankNNNNN.pt`); the size of one is `checkpoint_size.checkpoint_bytes`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from slime_search.utils.faults import disk_full_error

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
SAVED, DISK_FULL, FAILED = 0, 1, 2  # a save's outcome on a rank, agreed over all of them (the worst one)


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return 0 if text == "release" else int(text)


def saved_iterations(root: str | Path) -> list[int]:
    """The iterations of the complete checkpoints under `root`, in order."""
    return sorted(
        int(path.name[len("iter_") :])
        for path in Path(root).glob("iter_*")
        if path.is_dir() and path.name[len("iter_") :].isdigit()
    )


def prune_iterations(root: str | Path, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
    """Remove all but the newest `keep` complete checkpoints (never the one the tracker names, nor those of
    `protect`); returns the iterations removed. `keep` 0 keeps every one."""
    current = latest_iteration(root)
    found = saved_iterations(root)
    if keep <= 0:
        return []
    removed = [it for it in found[:-keep] if it != current and it not in protect]
    for iteration in removed:
        shutil.rmtree(iteration_dir(root, iteration))
    return removed


def rewind_to(root: str | Path, iteration: int, aside: str | Path) -> list[int]:
    """Make `iteration` the tracked checkpoint and move the newer ones into the folder `aside` (a rollback or a stop
    undid them; they are kept, not deleted, so an action taken in error loses nothing); returns the iterations moved.
    The tracker is replaced first, so a crash in between resumes from `iteration`; called again, it moves what is
    left (each folder moves whole, in one rename). A folder of `aside` that already holds one of those iterations is
    refused before anything changes: a set-aside never lands on another."""
    if not iteration_dir(root, iteration).is_dir():
        raise FileNotFoundError(f"no checkpoint of iteration {iteration} in {root}")
    newer = [it for it in saved_iterations(root) if it > iteration]
    taken = [it for it in newer if (Path(aside) / iteration_dir(root, it).name).exists()]
    if taken:
        raise FileExistsError(f"{aside} holds checkpoints of iterations {taken} already: set them aside elsewhere")
    tmp = Path(root) / (TRACKER + ".tmp")
    tmp.write_text(str(iteration))
    os.replace(tmp, Path(root) / TRACKER)
    if newer:
        Path(aside).mkdir(parents=True, exist_ok=True)
    for it in newer:
        os.replace(iteration_dir(root, it), Path(aside) / iteration_dir(root, it).name)
    return newer


def partial_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.partial"


def _start_save(root: str | Path, iteration: int) -> Path:
    """Collective: an empty partial folder (a stale one, from a save cut short, is removed)."""
    import torch.distributed as dist

    folder = partial_dir(root, iteration)

    def make_folder() -> None:
        if dist.get_rank() == 0:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)

    _write_all(root, iteration, make_folder)
    return folder


def _finish_save(root: str | Path, iteration: int, extra_files: dict[str, str] | None = None) -> Path:
    """Collective: rank 0 adds `extra_files` (name -> text), renames the folder into place, then the tracker. The
    tracker's new text is written before the rename and moved into place after it (a rename needs no room): a disk
    that fills up here fails the save with nothing renamed."""
    import torch.distributed as dist

    dist.barrier()  # every rank's files are in the partial folder
    final = iteration_dir(root, iteration)

    def put_in_place() -> None:
        if dist.get_rank() != 0:
            return
        partial = partial_dir(root, iteration)
        for name, text in (extra_files or {}).items():
            (partial / name).write_text(text)
        tmp = Path(root) / (TRACKER + ".tmp")
        tmp.write_text(str(iteration))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        os.replace(tmp, Path(root) / TRACKER)

    _write_all(root, iteration, put_in_place)
    return final


def _write_all(root: str | Path, iteration: int, write: Callable[[], None]) -> None:
    """Collective: `write()`, this rank's part of the save of `iteration`, then every rank's outcome agreed.

    When it failed anywhere, the partial folder is removed and every rank raises. A disk that was full, on this rank
    or another, raises OSError ENOSPC. Else a rank raises its own error, or a RuntimeError naming the failure of
    another rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException

    failure = None
    try:
        write()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank must reach the agreement below
        failure = err
    full = None if failure is None else _full_disk(failure, root)
    outcome = _agreed_outcome(SAVED if failure is None else DISK_FULL if full is not None else FAILED)
    if outcome == SAVED:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(partial_dir(root, iteration), ignore_errors=True)
    dist.barrier()
    if outcome == DISK_FULL:
        code = full.errno if full is not None else errno.ENOSPC
        where = f" ({full.strerror})" if full is not None else " (on another rank)"
        raise OSError(code, f"{os.strerror(code)} writing the checkpoint of iteration {iteration} in {root}{where}")
    if isinstance(failure, Exception):
        raise failure
    if failure is not None:  # torch's CheckpointException is a BaseException: raised on as an ordinary error
        raise RuntimeError(str(failure)) from failure
    raise RuntimeError(f"the save of iteration {iteration} in {root} failed on another rank")


NEARLY_FULL_BYTES = 64 << 20  # a save that failed with less free space on its disk failed for lack of it


def _full_disk(failure: BaseException, root: str | Path) -> OSError | None:
    """The full disk behind a failed write, or None.

    It is an OSError ENOSPC or EDQUOT along the error's causes. When the error says nothing of its cause, a disk with
    less than NEARLY_FULL_BYTES free counts (checked before the partial folder goes). The torch_dist shards and
    `torch.save` to a path go through torch's C++ writer. It reports a full disk without an errno, as "unexpected pos
    704 vs 598" or "basic_ios::clear: iostream error" (seen on a full tmpfs)."""
    full = disk_full_error(failure)
    if full is not None:
        return full
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if free >= NEARLY_FULL_BYTES:
        return None
    return OSError(errno.ENOSPC, f"{free / 2**20:.0f} MiB free after: {type(failure).__name__}: {failure}"[:300])


def _agreed_outcome(mine: int) -> int:
    """Collective: the worst outcome of every rank's part of a save (SAVED, DISK_FULL, FAILED)."""
    import torch
    import torch.distributed as dist

    outcome = torch.tensor([mine], dtype=torch.int32, device=_this_device())
    dist.all_reduce(outcome, op=dist.ReduceOp.MAX)
    return int(outcome.item())


def _write_results_in_process() -> None:
    """Megatron's torch_dist writer hands its write results over a queue, made on a process's first save, for saves that
    finish in another process. The queue is a multiprocessing Manager started with "spawn": a new Python that imports
    the caller's main module again. That costs about 2 CPU-seconds and a process per rank. `dist_checkpointing.save` is
    synchronous: the results are put and read in this process, so an in-process queue carries them. Left alone where
    Megatron made its queue already or no longer has one."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


def checkpointed_state(model) -> dict:
    """The model's sharded state dict as a checkpoint holds it: whole, or under LoRA only the adapters (what trains:
    the frozen base is the initial weights, which every start loads again)."""
    from slime_search.backends.megatron.lora import is_adapter, lora_modules

    sharded = model.sharded_state_dict(prefix="")
    if next(lora_modules(model), None) is None:
        return sharded
    return {name: entry for name, entry in sharded.items() if is_adapter(name)}


def _save_model_files(model, folder: Path) -> None:
    from megatron.core import dist_checkpointing

    _write_results_in_process()
    dist_checkpointing.save(checkpointed_state(model), str(folder))


def save_model(model, root: str | Path, iteration: int) -> Path:
    """Collective: every rank calls it. A model-only checkpoint; returns the iteration folder."""
    folder = _start_save(root, iteration)
    _write_all(root, iteration, lambda: _save_model_files(model, folder))
    return _finish_save(root, iteration)


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
    expected = checkpointed_state(model)
    state = dist_checkpointing.load(held_request(expected, folder), str(folder))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k in expected and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(
            f"checkpoint {folder} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return iteration


def held_request(sharded: dict, folder: Path) -> dict:
    """The entries of a model's sharded state dict to load from the checkpoint in `folder`.

    They are all of them, less the `_extra_state` objects the checkpoint does not hold. Such an object is a module's
    extra state: TransformerEngine's FP8 scaling metadata, empty without FP8. A layer spec may keep one where the spec
    a checkpoint was written with kept none. Examples are TransformerEngine's q/k RMSNorm of Qwen3 against the local
    spec's, or a converter that writes no extra state at all. The module then starts from its defaults. Any other entry
    the checkpoint lacks is an error."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    held = load_sharded_metadata(str(folder))  # ShardedTensors by key, ShardedObjects by unique key
    request, left_out, missing = {}, [], []
    for name, entry in sharded.items():
        if not isinstance(entry, ShardedBase):
            request[name] = entry
            continue
        stored = entry.unique_key if isinstance(entry, ShardedObject) else entry.key
        if stored in held:
            request[name] = entry
        elif isinstance(entry, ShardedObject) and entry.key.endswith("_extra_state"):
            left_out.append(name)
        else:
            missing.append(stored)
    if missing:
        raise KeyError(f"checkpoint {folder} does not fit the model: it holds no {', '.join(missing[:5])}")
    if left_out:
        logger.info("checkpoint %s holds no extra state of %d modules: they start from defaults", folder, len(left_out))
    return request


def optimizer_file(tp_rank: int) -> str:
    """The optimizer state of tensor-parallel slice `tp_rank`, written once: the data-parallel ranks of a slice hold
    the same state (Megatron's non-distributed optimizer steps every replica alike on all-reduced gradients)."""
    return f"optimizer_tp{tp_rank:02d}.pt"


def _legacy_optimizer_file() -> str:
    """Where checkpoints of an earlier layout kept this rank's optimizer state (one file per rank)."""
    import torch.distributed as dist

    return f"optimizer_rank{dist.get_rank():05d}.pt"


def _rng_name() -> str:
    import torch.distributed as dist

    return f"rng_rank{dist.get_rank():05d}.pt"


def rng_state() -> dict:
    """This process's random states (python, numpy, torch CPU and CUDA, and Megatron's model-parallel streams), to
    continue a run bit for bit. Megatron's transformer block runs under sequence parallelism inside its tracker's
    model-parallel stream: LoRA's dropout draws from that stream there, so the tracker's states belong here too (as
    Megatron's own checkpoints keep `rng_tracker_states`)."""
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["tracker"] = get_cuda_rng_tracker().get_states()  # a fork replaces its state, never changes it in place
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
    if state.get("tracker"):  # absent from checkpoints written before it was kept
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def save_actor(actor, root: str | Path, iteration: int, extra_files: dict[str, str] | None = None) -> Path:
    """Collective: the actor's state and `extra_files` in one iteration folder that appears complete or not at all.

    The model is saved as torch_dist (reshardable). The optimizer state is saved once per tensor-parallel slice, by
    its first data-parallel rank: it resumes at the same TP size, any DP size. The RNG state is saved per rank.
    `extra_files` (name -> text; the run's rollout state) are written by rank 0."""
    from megatron.core import parallel_state

    folder = _start_save(root, iteration)

    def write() -> None:
        # a shard that fails to write fails the save on every rank (torch_dist agrees on it); the one file it writes
        # before agreeing on anything, rank 0's common state, meets a full disk only where the driver's check of the
        # room before the save (RunParts.save) did not see it coming
        _save_model_files(actor.model.module, folder)
        if hasattr(actor.optimizer, "state_dict"):
            state = actor.optimizer.state_dict()  # on every rank: references, no copy; refused alike where unsupported
            if parallel_state.get_data_parallel_rank() == 0:
                tp = parallel_state.get_tensor_model_parallel_world_size()
                saved = {"tensor_parallel_size": tp, "optimizer": state}
                _torch_save(saved, folder / optimizer_file(parallel_state.get_tensor_model_parallel_rank()))
        _torch_save(rng_state(), folder / _rng_name())

    _write_all(root, iteration, write)
    return _finish_save(root, iteration, extra_files)


def _torch_save(obj, path: Path) -> None:
    """torch.save through a Python file: a disk that fills up raises OSError ENOSPC then. Given a path, torch writes
    with its own C++ stream, and a full disk raises RuntimeError("basic_ios::clear: iostream error"), which says
    nothing of the cause (seen on a full tmpfs)."""
    import torch

    with open(path, "wb") as handle:
        torch.save(obj, handle)


def _this_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _load_optimizer(optimizer, folder: Path) -> None:
    """This rank's slice of the optimizer state: its tensor-parallel slice's file (any data-parallel size), else the
    rank's own file of the earlier layout (the parallel layout it was saved with)."""
    import torch
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    path = folder / optimizer_file(parallel_state.get_tensor_model_parallel_rank())
    if path.is_file():
        saved = _own_storage(torch.load(path, weights_only=False, map_location=_this_device()))
        if saved["tensor_parallel_size"] != tp:
            raise ValueError(
                f"the optimizer state in {folder} is of tensor-parallel size {saved['tensor_parallel_size']}: resume "
                f"with --tensor-model-parallel-size {saved['tensor_parallel_size']} (this run has {tp}), or start a "
                f"new run from its weights with --load {folder.parent}"
            )
        optimizer.load_state_dict(saved["optimizer"])
        return
    legacy = folder / _legacy_optimizer_file()
    if not legacy.is_file():
        slices = len(list(folder.glob("optimizer_tp*.pt")))
        raise FileNotFoundError(
            f"no optimizer state {path.name} in {folder} (it holds {slices} tensor-parallel slices): resume with the "
            f"--tensor-model-parallel-size it was saved with"
        )
    optimizer.load_state_dict(_own_storage(torch.load(legacy, weights_only=False, map_location=_this_device())))


def _own_storage(value):
    """`value` with each CPU tensor copied into a storage of its own. torch.load's CPU tensors share the file's buffer,
    which cannot be resized. The colocated hand-over (offload.py) frees every storage the optimizer holds by resizing
    it to zero bytes."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone() if value.device.type == "cpu" else value
    if isinstance(value, dict):
        return {key: _own_storage(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_own_storage(item) for item in value)
    return value


def load_actor(actor, root: str | Path, iteration: int | None = None, load_optimizer: bool = True) -> int:
    import torch

    iteration = load_model(actor.model.module, root, iteration)
    if load_optimizer and hasattr(actor.optimizer, "load_state_dict"):
        _load_optimizer(actor.optimizer, iteration_dir(root, iteration))
    rng = iteration_dir(root, iteration) / _rng_name()
    if load_optimizer and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return iteration
