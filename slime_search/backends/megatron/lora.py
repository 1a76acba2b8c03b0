"""Low-rank adapters (LoRA) on the Megatron actor's projections, with the base weights frozen.

The design is Megatron-Bridge's LoRA (`megatron/bridge/peft/lora.py` and its `ParallelLinearAdapter`). Each targeted
linear is wrapped. Its adapter is built from Megatron's own parallel layers, so it is split the way its layer is and its
gradients are reduced by the same collectives:

- a column-parallel base (`linear_qkv`, `linear_fc1`): A = ColumnParallelLinear(in -> r, output gathered), B =
  ColumnParallelLinear(r -> out, output split like the base's rows);
- a row-parallel base (`linear_proj`, `linear_fc2`): A = RowParallelLinear(in -> r, input split like the base's),
  B = ColumnParallelLinear(r -> out, output gathered).

The adapter layers themselves run without sequence parallelism. Under it, a column-parallel base's sequence-sharded
input is gathered for the adapter; its gradient is split back, as A's input already sums it over the ranks. A
row-parallel base's adapter output is scattered to the sequence shard its base returns. Fused projections keep one A and
one B: on `linear_qkv` it is PEFT's q/k/v adapters sharing one A (B's rows in Megatron's group-interleaved order), on
`linear_fc1` gate/up sharing one A.

    y = base(x) + (alpha / r) * B(A(dropout(x)))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from slime_search.config.lora import LoraConfig

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the base's output rows are split over the TP ranks
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # the base's input columns are
LORA_RECORD = "lora_config.json"  # in a LoRA checkpoint's iteration folder: the adapters' settings and the base


class LoRALinear(torch.nn.Module):
    """A frozen Megatron linear with a trainable low-rank adapter beside it; returns what the base returns (output,
    bias), the adapter's output added."""

    def __init__(self, base: torch.nn.Module, kind: str, config: LoraConfig, model_config) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = config.lora_rank
        if rank % tp:
            raise ValueError(f"--lora-rank {rank} must be a multiple of the tensor-parallel size {tp}")
        self.base = base
        self.row_parallel = kind in ROW_PARALLEL
        self.gated = kind == "linear_fc1" and model_config.gated_linear_unit  # rows: [gate; up] within each TP shard
        self.scale = config.scale
        self.enabled = True
        self.sequence_parallel = model_config.sequence_parallel
        self.dropout = torch.nn.Dropout(config.lora_dropout) if config.lora_dropout else torch.nn.Identity()
        adapter_config = dataclasses.replace(model_config, sequence_parallel=False)
        in_features, out_features = base.input_size, base.output_size  # the full sizes, on every rank
        kaiming = _kaiming_uniform  # PEFT's initialisation of A; B starts at zero, so the adapter starts as no change
        if self.row_parallel:
            self.linear_in = RowParallelLinear(
                in_features, rank, config=adapter_config, init_method=kaiming, bias=False,
                input_is_parallel=True, skip_bias_add=True,
            )  # fmt: skip
            gather_out = True
        else:
            self.linear_in = ColumnParallelLinear(
                in_features, rank, config=adapter_config, init_method=kaiming, bias=False, gather_output=True
            )
            gather_out = False
        self.linear_out = ColumnParallelLinear(
            rank, out_features, config=adapter_config, init_method=torch.nn.init.zeros_, bias=False,
            gather_output=gather_out,
        )  # fmt: skip

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """A torch_dist checkpoint's entries: each part sharded as the Megatron layer it is (the base as before, under
        `base.`). A gated fc1's rows are each TP shard's gate rows then its up rows. So its weight and B are stored as
        Megatron's MLP stores fc1 (apply_swiglu_sharded_factory: the gate halves, then the up halves). Stored so,
        they load at any TP size. (The MLP applies that factory to `linear_fc1.weight` only, not to the names under
        this wrapper.)"""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = {}
        for name in ("base", "linear_in", "linear_out"):
            out.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata))
        if self.gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            for key in (f"{prefix}base.weight", f"{prefix}linear_out.weight"):
                out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return output, bias
        return output + self.delta(x), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        if self.sequence_parallel and not self.row_parallel:
            # the base gathers its sequence-sharded input itself; A's input sums its gradient over the ranks already,
            # so the gather's backward only splits it
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        low, _ = self.linear_in(self.dropout(x))
        out, _ = self.linear_out(low)
        if self.sequence_parallel and self.row_parallel:
            out = scatter_to_sequence_parallel_region(out)  # the base's output is reduce-scattered to this shard
        return out * self.scale

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of the base weight with the adapter folded in: W + scale * B @ A (the other factor of
        each pair is gathered over the TP ranks)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        a, b = self.linear_in.weight.detach(), self.linear_out.weight.detach()
        if self.row_parallel:  # A: [r, in/tp], B: [out/tp, r] of an output gathered on every rank
            b = gather_from_tensor_model_parallel_region(b.t().contiguous()).t()
        else:  # A: [r/tp, in], gathered along r; B: [out/tp, r]
            a = gather_from_tensor_model_parallel_region(a.t().contiguous()).t()
        weight = self.base.weight.detach()
        return weight + (self.scale * (b.float() @ a.float())).to(weight.dtype)


def _kaiming_uniform(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> list[str]:
    """Wrap every targeted projection of `model` (a GPTModel on Megatron's local spec) in a LoRALinear, and freeze
    every weight that is not an adapter's. Returns the wrapped modules' paths."""
    if not config.enabled:
        return []
    wrapped = []
    projections = config.projections
    for path, module in list(model.named_modules()):
        if path.rsplit(".", 1)[-1] not in projections:
            continue
        if hasattr(module, "return_layernorm_output") or type(module).__name__.startswith("TE"):
            raise ValueError(
                f"LoRA wraps Megatron's local linears; {path} is TransformerEngine's {type(module).__name__} "
                "(use --attention-impl packed)"
            )
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, LoRALinear(module, name, config, model.config))
        wrapped.append(path)
    if not wrapped:
        raise ValueError(f"no module of the model is one of the LoRA projections {projections}")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter(name))
    return wrapped


def is_adapter(name: str) -> bool:
    return ".linear_in." in name or ".linear_out." in name


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield path, module


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model, the adapters left out (the KL reference under LoRA: no second model is loaded)."""
    modules = [module for _, module in lora_modules(model)]
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


def merged_state_dict(model: torch.nn.Module, fold: bool = True) -> dict[str, torch.Tensor]:
    """This rank's shard of the model's weights under the names of the model without adapters, each adapter folded
    into its base weight: what the HF conversion, the weight push and the engines take. `fold=False`: the frozen base
    alone (what engines that serve the adapters by name need beneath them)."""
    merged = {f"{path}.weight": module.merged_weight() for path, module in lora_modules(model)} if fold else {}
    out = {}
    for name, tensor in model.state_dict().items():
        if is_adapter(name) or name.endswith("_extra_state"):
            continue
        plain = name.replace(".base.", ".")
        out[plain] = merged.get(plain, tensor)
    return out


def full_adapters(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every adapter's A [r, in] and B [out, r], whole, B's rows in Megatron's order (collective over the TP group:
    every rank calls it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_bridge import gather_tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()

    def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    out = {}
    for path, module in lora_modules(model):
        a, b = module.linear_in.weight.detach(), module.linear_out.weight.detach()
        if module.row_parallel:  # A split along its input like the base's columns, B along its rows
            out[path] = (torch.cat(gathered(a), dim=1), torch.cat(gathered(b), dim=0))
        else:  # A split along r, B's rows like the base weight's (query groups, or fc1's gate and up halves)
            name = f"{path}.weight"
            full_b = gather_tensor_parallel([{name: part} for part in gathered(b)])[name]
            out[path] = (torch.cat(gathered(a), dim=0), full_b)
    return out


def lora_record(config: LoraConfig, hf_checkpoint: str, load: str | None) -> str:
    """A LoRA checkpoint's LORA_RECORD: the adapters' settings and where the frozen base's weights came from (local
    folders made absolute, so that the record holds from any working directory)."""

    def located(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path is not None and Path(path).exists() else path

    record = {"lora": dataclasses.asdict(config), "hf_checkpoint": located(hf_checkpoint), "load": located(load)}
    return json.dumps(record, indent=1)


def read_lora_record(iteration_folder) -> tuple[LoraConfig, dict]:
    """The LoraConfig and the base's sources ({"hf_checkpoint", "load"}) a LoRA checkpoint was saved with."""
    path = Path(iteration_folder) / LORA_RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {iteration_folder} is not a checkpoint of a --lora-rank run")
    record = json.loads(path.read_text())
    return LoraConfig(**record["lora"]), {"hf_checkpoint": record["hf_checkpoint"], "load": record["load"]}
