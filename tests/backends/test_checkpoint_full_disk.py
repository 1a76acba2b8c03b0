"""A real torch_dist save of the actor onto a real disk that fills up mid-save (a tmpfs of a size the test chooses): the
save raises OSError ENOSPC on every rank, the partial folder is gone, the earlier checkpoint and the tracker are as
they were and still load; once room is made the same save succeeds. Needs root to mount the tmpfs (skipped without)."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port
from tests.backends.test_megatron_train import _actor_from_hf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BALLAST = "ballast"


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _full_disk_worker(rank: int, world: int, port: int, checkpoint: str, mount: str, out_path: str) -> None:
    from slime_search.backends.megatron.checkpoint import latest_iteration, load_actor, save_actor
    from slime_search.backends.megatron.distributed import shutdown

    _, _, _, _, actor, samples, _ = _actor_from_hf(rank, world, port, checkpoint)
    root = Path(mount) / "checkpoints"
    save_actor(actor, root, 1, {"rollout_state.json": "{}"})
    if rank == 0:  # ballast leaves room for half of the checkpoint just saved: the next save fills the disk mid-way
        one = sum(p.stat().st_size for p in (root / "iter_0000001").iterdir())
        (Path(mount) / BALLAST).write_bytes(b"\0" * (shutil.disk_usage(mount).free - one // 2))
    torch.distributed.barrier()
    actor.train_step(samples)
    try:
        save_actor(actor, root, 2, {"rollout_state.json": "{}"})
        failed = None
    except OSError as err:
        failed = [err.errno, str(err)]
    after_failure = (listing(root), latest_iteration(root))
    loaded = load_actor(actor, root)  # the earlier checkpoint is whole
    torch.distributed.barrier()
    if rank == 0:
        (Path(mount) / BALLAST).unlink()  # room is made
    torch.distributed.barrier()
    save_actor(actor, root, 2, {"rollout_state.json": "{}"})
    result = {"failed": failed, "after_failure": after_failure, "loaded": loaded, "after_retry": listing(root),
              "tracker": latest_iteration(root), "reloaded": load_actor(actor, root)}  # fmt: skip
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    shutdown()


@pytest.fixture
def small_disk(tmp_path, tiny_checkpoint):
    """A tmpfs that holds 3 checkpoints of the tiny actor (by checkpoint_bytes; the worker fills it with ballast after
    the first save, by what that save weighed)."""
    from transformers import AutoConfig

    from megatron_bridge import ModelShape, pad_vocab_size
    from slime_search.backends.megatron.checkpoint_size import checkpoint_bytes, layout_of_shape

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_checkpoint))
    size = checkpoint_bytes(layout_of_shape(shape, pad_vocab_size(shape.vocab_size, 128, 1), 1, param_bytes=4))
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("world", [1, 2])
def test_a_save_that_fills_the_disk_fails_on_every_rank_and_loses_nothing(tiny_checkpoint, small_disk, tmp_path, world):
    out = tmp_path / "result.json"
    args = (world, free_port(), str(tiny_checkpoint), str(small_disk), str(out))
    mp.spawn(_full_disk_worker, args=args, nprocs=world, join=True)  # a rank left waiting would hit the timeout
    result = json.loads(out.read_text())
    assert result["failed"] is not None and result["failed"][0] == errno.ENOSPC, result
    assert "writing the checkpoint of iteration 2" in result["failed"][1]
    assert result["after_failure"] == [["iter_0000001", "latest_checkpointed_iteration.txt"], 1]  # no partial left
    assert result["loaded"] == 1
    assert result["after_retry"] == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert result["tracker"] == 2 and result["reloaded"] == 2
