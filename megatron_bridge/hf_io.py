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
    copy_hf_files(original, out)
    return out


def copy_hf_files(original: Path, out: Path) -> None:
    """The original folder's config, generation config and tokenizer files, beside the weights."""
    for name in COPIED:
        if (original / name).is_file():
            shutil.copy2(original / name, out / name)


def save_hf_shards(buckets, original: Path, out: Path) -> Path:
    """Write an HF folder from buckets of (HF name, tensor) as they come, one safetensors shard per bucket, so only one
    bucket is ever held. A single bucket becomes `model.safetensors`. More become `model-0000i-of-0000n.safetensors` and
    the `model.safetensors.index.json` that maps each weight to its shard, which `from_pretrained` reads."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    total = 0
    for bucket in buckets:
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
        if not tensors:
            continue
        path = out / f"shard-{len(written):05d}.part"
        save_file(tensors, str(path), metadata={"format": "pt"})
        written.append((path, list(tensors)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if not written:
        raise ValueError("no weights to write")
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
    else:
        weight_map = {}
        for index, (path, names) in enumerate(written, 1):
            final = f"model-{index:05d}-of-{len(written):05d}.safetensors"
            path.rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))
    copy_hf_files(original, out)
    return out


def read_hf_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The weights of an HF folder by name, read from its safetensors files (`model.safetensors`, or the shards that
    `model.safetensors.index.json` names), in their stored dtype. No model is built, so neither the HF model classes
    nor a second copy of the weights in fp32 are needed. A folder without safetensors (`pytorch_model.bin`) is read
    through `transformers`, in fp32."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state
