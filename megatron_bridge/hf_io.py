"""Write HF checkpoint folders: weights as safetensors, config and tokenizer copied from the original folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def save_hf_folder(hf_state: dict[str, torch.Tensor], original: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in hf_state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (original / name).is_file():
            shutil.copy2(original / name, out / name)
    return out
