"""Where the run's weights come from and go, its command-line flags declared as its fields (slime's names)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_search.utils.flag_fields import REQUIRED, flag
from slime_search.utils.flag_types import non_negative_int


def no_save_hf_path(text: str) -> bool:
    """slime's --save-hf takes a folder; here each checkpoint's HF folder is SAVE/hf/step_N."""
    raise argparse.ArgumentTypeError(
        f"takes no folder here (got {text}): each checkpoint's HF folder is written to SAVE/hf/step_N; give --save-hf "
        "alone"
    )


@dataclass(frozen=True)
class CheckpointConfig:
    hf_checkpoint: str = flag(REQUIRED, "HF folder: architecture, tokenizer, initial weights", slime=True)
    save: str = flag(REQUIRED, "run folder: checkpoints, synced weights, metrics, report", slime=True)
    load: str | None = flag(None, "torch_dist folder with the initial actor weights (else the HF ones)", slime=True)
    ref_load: str | None = flag(None, "torch_dist folder of the KL reference (else the initial weights)", slime=True)
    save_interval: int = flag(0, "checkpoint every N steps (0: only at the end)", type=non_negative_int, slime=True)
    keep_checkpoints: int = flag(
        2, "newest checkpoints kept in SAVE/checkpoints (0: all of them)", type=non_negative_int
    )
    save_hf: bool = flag(
        False,
        "also write each checkpoint's weights as an HF folder (SAVE/hf/step_N: weights, config, tokenizer), kept and "
        "pruned with its checkpoint",
        nargs="?",
        const=True,
        type=no_save_hf_path,
        slime=True,
    )
    seed: int = flag(
        1234,
        "seeds the actor's RNGs (Python, NumPy, torch, Megatron's model-parallel RNG) and the engines' sampling "
        "(engine i: seed + i)",
        type=non_negative_int,
        slime=True,
    )
