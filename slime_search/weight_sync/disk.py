"""Weight sync through the disk.

Rank 0 writes an HF checkpoint (safetensors + the original config and tokenizer) into a fresh folder. It renames the
folder into place. Every engine loads it through `/update_weights_from_disk` with the new weight_version. This works
with every engine and placement. Only the newest copy is kept.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import torch

from megatron_bridge import ModelShape, megatron_to_hf
from slime_search.weight_sync.transport_base import WeightTransport, check_served, served_versions


def write_hf_checkpoint(
    megatron_state: dict[str, torch.Tensor],
    shape: ModelShape,
    original_hf: str | Path,
    out_dir: str | Path,
    te_names: bool,
) -> Path:
    """Write an HF checkpoint atomically: a temporary sibling folder renamed into place when complete."""
    from megatron_bridge.hf_io import save_hf_folder

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    hf_state = megatron_to_hf(megatron_state, shape, te_names=te_names)
    if shape.tie_word_embeddings:
        hf_state.pop("lm_head.weight")
    save_hf_folder(hf_state, Path(original_hf), tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


async def update_engines_from_disk(engine_urls: list[str], model_path: str, weight_version: str) -> list[str]:
    """Every engine loads `model_path`; returns the versions they then serve (all must equal `weight_version`).
    SGLang's answer says only whether the load succeeded; the served version is read from GET /model_info."""
    from slime_search.engines.client import call_engine, check_success, on_every_engine

    async def one(url: str) -> None:
        check_success(
            url,
            "update_weights_from_disk",
            await call_engine(url, "update_weights_from_disk", model_path, weight_version),
        )

    await on_every_engine(engine_urls, one)
    return await served_versions(engine_urls)


class DiskTransport(WeightTransport):
    def push(self, version: str) -> str:
        folder = Path(self.config.disk_dir) / f"step_{version}"
        written = self.group.on_all_ranks("write_hf", self.config.hf_checkpoint, str(folder))[0]
        served = check_served(asyncio.run(update_engines_from_disk(self.engine_urls, written, version)), version)
        for older in folder.parent.glob("step_*"):
            if older != folder:
                shutil.rmtree(older, ignore_errors=True)
        return served
