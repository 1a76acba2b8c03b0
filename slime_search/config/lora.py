"""LoRA's flags (miles' names), declared as the fields of `LoraConfig`: with --lora-rank above 0 the actor trains
low-rank adapters on its projections and its base weights stay frozen (backends/megatron/lora.py)."""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import non_negative_int, positive_float

# Megatron's projections, each with the HF (PEFT) projections it fuses
PROJECTIONS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


# The one adapter name engines serve under --lora-sync-from-tensor: each push replaces the adapter of that name (no
# request is in flight then: the rollout has drained), so a request names the same adapter all run long.
SERVED_ADAPTER = "policy"


def dropout_probability(text: str) -> float:
    import argparse

    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


@dataclass(frozen=True)
class LoraConfig:
    lora_rank: int = flag(0, "rank of the LoRA adapters (0: no LoRA, every weight trains)", type=non_negative_int)
    lora_alpha: float = flag(32.0, "LoRA's alpha: the adapters' output is scaled by alpha / rank", type=positive_float)
    lora_dropout: float = flag(0.0, "dropout on the adapters' input", type=dropout_probability)
    target_modules: str = flag(
        "all-linear",
        "the projections that get adapters, comma-separated: PEFT's names (q_proj,k_proj,v_proj,o_proj,gate_proj,"
        "up_proj,down_proj) or Megatron's (linear_qkv,linear_proj,linear_fc1,linear_fc2), or all-linear; q/k/v and "
        "gate/up go together (Megatron fuses them)",
    )
    exclude_modules: str | None = flag(None, "projections left without adapters, comma-separated (the same names)")
    lora_sync_from_tensor: bool = flag(
        False,
        "push the adapters alone after each step, from tensors, into SGLang's LoRA (engines with --enable-lora; every "
        "/generate names the adapter): megabytes instead of the whole model. Without it each push carries the weights "
        "with the adapters folded in, by --update-weight-transport",
    )
    lora_adapter_path: str | None = flag(
        None,
        "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) the adapters start from instead of "
        "zero; its r and lora_alpha must equal --lora-rank and --lora-alpha. A resumed run's checkpoint takes "
        "precedence",
    )

    def __post_init__(self) -> None:
        if self.lora_rank:
            self.projections  # noqa: B018  (checks the names)
        elif self.lora_adapter_path:
            raise ValueError("--lora-adapter-path needs --lora-rank (the folder's r)")
        elif self.lora_sync_from_tensor:
            raise ValueError("--lora-sync-from-tensor needs --lora-rank: without LoRA there is no adapter to push")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def served_adapter(self) -> str | None:
        """The name the engines serve the adapters under (every /generate names it), or None when each push carries
        the folded weights."""
        return SERVED_ADAPTER if self.lora_sync_from_tensor else None

    @property
    def hf_target_modules(self) -> list[str]:
        """The HF (PEFT) projections that get adapters."""
        return [name for projection in self.projections for name in PROJECTIONS[projection]]

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The Megatron projections that get adapters: --target-modules less --exclude-modules."""
        chosen = [p for p in PROJECTIONS if p in _megatron_names(self.target_modules, "--target-modules")]
        excluded = _megatron_names(self.exclude_modules or "", "--exclude-modules")
        projections = tuple(p for p in chosen if p not in excluded)
        if not projections:
            raise ValueError(f"--target-modules {self.target_modules} less --exclude-modules leaves no projection")
        return projections


def _megatron_names(text: str, flag_name: str) -> set[str]:
    names = {name.strip() for name in text.split(",") if name.strip()}
    if "all-linear" in names:
        return set(PROJECTIONS)
    out = set()
    for projection, hf_names in PROJECTIONS.items():
        given = names & {projection, *hf_names}
        if given - {projection} and not set(hf_names) <= names and projection not in names:
            raise ValueError(
                f"{flag_name}: {', '.join(sorted(given))} without {', '.join(sorted(set(hf_names) - names))}: Megatron "
                f"fuses {', '.join(hf_names)} into {projection}, which takes one adapter; name all of them"
            )
        if given:
            out.add(projection)
    unknown = names - {name for p, hf in PROJECTIONS.items() for name in (p, *hf)}
    if unknown:
        raise ValueError(
            f"{flag_name}: unknown projections {sorted(unknown)}; use all-linear, {', '.join(PROJECTIONS)}"
        )
    return out
