"""PEFT's adapter folder (adapter_config.json, adapter_model.safetensors), both ways: the actor's adapters written for
PEFT and SGLang (--save-hf, tools/convert_lora_to_hf.py), and a folder read onto the actor (--lora-adapter-path).

PEFT keeps one adapter per HF projection. Megatron fuses q/k/v into linear_qkv and gate/up into linear_fc1, and each
fused projection takes one adapter. Written, a fused adapter's A is shared by the projections it fuses and its B's rows
are split between them. Read, the projections a fused one stands for must share one A. A folder whose q/k/v (or
gate/up) adapters have A's of their own has no exact form on Megatron's layers, so it is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from slime_search.config.lora import PROJECTIONS, LoraConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
HF_MODULE = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
MEGATRON_MODULE = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}
PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
MEGATRON_OF = {hf: projection for projection, names in PROJECTIONS.items() for hf in names}


def peft_adapter_state(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], shape) -> dict[str, torch.Tensor]:
    """The adapters ({Megatron module path: (A, B)}) under PEFT's names for the HF model: a fused projection's A shared
    by the HF projections it fuses, its B's rows split between them."""
    from megatron_bridge.qwen import split_qkv

    out = {}
    for path, (a, b) in adapters.items():
        layer, projection = path.split(".")[2], path.rsplit(".", 1)[-1]
        if projection == "linear_qkv":
            parts = split_qkv(b, shape)
        elif projection == "linear_fc1":
            parts = b.chunk(2, dim=0)
        else:
            parts = (b,)
        for name, part in zip(PROJECTIONS[projection], parts, strict=True):
            prefix = f"base_model.model.model.layers.{layer}.{HF_MODULE[projection]}.{name}"
            out[f"{prefix}.lora_A.weight"] = a.clone()
            out[f"{prefix}.lora_B.weight"] = part.contiguous()
    return out


def peft_adapter_config(config: LoraConfig, base_model: str) -> dict:
    """PEFT's adapter_config.json for adapters on the projections `config` names."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": [name for projection in config.projections for name in PROJECTIONS[projection]],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def save_peft_adapter(
    folder, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], shape, config: LoraConfig, base_model: str
) -> None:
    """A PEFT adapter folder that PEFT and SGLang load onto the HF base model."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft_adapter_state(adapters, shape), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(peft_adapter_config(config, base_model), indent=1))


def check_peft_config(folder: Path, config: LoraConfig) -> None:
    """The folder's adapter_config.json must describe the adapters the flags build; ValueError naming what differs."""
    path = folder / CONFIG_FILE
    if not path.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"--lora-adapter-path {folder}: a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    peft = json.loads(path.read_text())
    if peft.get("peft_type", "LORA") != "LORA" or peft.get("use_dora") or peft.get("bias", "none") != "none":
        raise ValueError(
            f"--lora-adapter-path {folder}: only plain LoRA adapters load (peft_type LORA, no DoRA, bias none)"
        )
    differs = [
        f"{flag} {ours:g} but the folder's {key} is {peft.get(key)}"
        for flag, key, ours in (
            ("--lora-rank", "r", config.lora_rank),
            ("--lora-alpha", "lora_alpha", config.lora_alpha),
        )
        if peft.get(key) is None or float(peft[key]) != float(ours)
    ]
    if differs:
        raise ValueError(f"--lora-adapter-path {folder}: {'; '.join(differs)} (set the flags to the folder's values)")


def read_peft_adapters(folder, config: LoraConfig) -> dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]]:
    """A PEFT folder's adapters grouped by Megatron's projections: {(layer, projection): (the shared A, the B of each HF
    projection it fuses, in Megatron's order)}. ValueError when the folder does not fit the flags: its settings, a
    projection it lacks or has beyond --target-modules, or fused projections with A's of their own."""
    from safetensors.torch import load_file

    folder = Path(folder)
    check_peft_config(folder, config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        match = PEFT_KEY.fullmatch(key.replace(".default.", "."))
        if match is None or match[3] not in MEGATRON_OF:
            raise ValueError(f"--lora-adapter-path {folder}: {key} is not a LoRA weight of a decoder projection")
        layer, name, side = int(match[1]), match[3], match[4]
        pairs.setdefault((layer, MEGATRON_OF[name]), {})[f"{name}.{side}"] = tensor
    extra = sorted({projection for _, projection in pairs} - set(config.projections))
    if extra:
        raise ValueError(
            f"--lora-adapter-path {folder} has adapters on {', '.join(extra)}, which --target-modules "
            f"{config.target_modules} (less --exclude-modules) leaves out"
        )
    layers = sorted({layer for layer, _ in pairs})
    out = {}
    for layer in layers:
        for projection in config.projections:
            out[(layer, projection)] = _fused_pair(folder, layer, projection, pairs.get((layer, projection), {}))
    return out


def _fused_pair(folder: Path, layer: int, projection: str, tensors: dict[str, torch.Tensor]):
    names = PROJECTIONS[projection]
    missing = [f"{name}.lora_{side}" for name in names for side in "AB" if f"{name}.{side}" not in tensors]
    if missing:
        raise ValueError(f"--lora-adapter-path {folder}: layer {layer} has no {', '.join(missing)}")
    a = tensors[f"{names[0]}.A"]
    if any(not torch.equal(tensors[f"{name}.A"], a) for name in names[1:]):
        raise ValueError(
            f"--lora-adapter-path {folder}: layer {layer}'s {', '.join(names)} adapters have A's of their own; "
            f"Megatron fuses them into {projection}, which takes one A shared by all of them (as this project saves "
            "them)"
        )
    return a, [tensors[f"{name}.B"] for name in names]


def megatron_adapters_from_peft(peft: dict, shape) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """read_peft_adapters' pairs on Megatron's fused projections, whole: {Megatron module path: (A, B)}."""
    from megatron_bridge.qwen import fuse_qkv

    out = {}
    for (layer, projection), (a, bs) in peft.items():
        b = fuse_qkv(*bs, shape) if projection == "linear_qkv" else torch.cat(bs)
        out[f"decoder.layers.{layer}.{MEGATRON_MODULE[projection]}.{projection}"] = (a, b)
    return out


def load_peft_adapters(model: torch.nn.Module, folder, config: LoraConfig, shape) -> None:
    """Set the adapters of `model` (wrapped by apply_lora) to a PEFT folder's, this rank's shard of each."""
    from megatron.core import parallel_state

    from megatron_bridge import shard_tensor_parallel
    from slime_search.backends.megatron.lora import lora_modules

    full = megatron_adapters_from_peft(read_peft_adapters(folder, config), shape)
    modules = dict(lora_modules(model))
    if set(full) != set(modules):
        raise ValueError(
            f"--lora-adapter-path {folder} has adapters for {len(full)} projections, the model {len(modules)}: "
            "the folder was trained on another model"
        )
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for path, module in modules.items():
            a, b = full[path]
            if module.row_parallel:  # A split like the base's input columns, B along its rows
                a, b = a.chunk(tp, dim=1)[rank], b.chunk(tp, dim=0)[rank]
            else:  # A split along r, B's rows like the base weight's (query groups, or fc1's gate and up halves)
                a = a.chunk(tp, dim=0)[rank]
                b = shard_tensor_parallel({f"{path}.weight": b}, shape, tp, rank)[f"{path}.weight"]
            for target, value in ((module.linear_in.weight, a), (module.linear_out.weight, b)):
                if target.shape != value.shape:
                    raise ValueError(
                        f"--lora-adapter-path {folder}: {path} takes a {tuple(target.shape)} shard on this rank, the "
                        f"folder gives {tuple(value.shape)}: the folder was trained on another model"
                    )
                target.copy_(value)
