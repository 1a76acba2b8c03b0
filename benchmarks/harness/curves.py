"""The reward and held-out curves of the two shapes the project runs: the 3B recipe's and the CPU miniature's.

The recipe's shape: Search-R1 (arXiv 2503.09516) and the peers' reports of Qwen2.5-3B GRPO (held-out EM about 0.1 at
the start and 0.31-0.42 over the seven sets at the end); its noise from 32 prompts x 8 samples. The miniature's: its
own runs (docs/benchmarks/health.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    steps: int
    eval_interval: int
    questions: int
    start: float  # reward and EM at step 0
    reward_level: float  # the training reward's plateau
    em_level: float  # the held-out EM's plateau
    rise_steps: float  # the time constant of the rise: level - (level - start) exp(-t / rise_steps)
    reward_sd: float  # of the training reward's step mean
    collapse_to: float  # the collapse's floor, a share of the level it starts from
    collapse_steps: int
    collapse_from: tuple[int, int]  # the range of steps the collapse begins in


SHAPES = {
    "recipe": Shape(1000, 25, 3000, 0.1, 0.4, 0.42, 100.0, 0.05, 0.25 / 0.42, 100, (400, 800)),
    "miniature": Shape(40, 2, 64, 0.06, 0.95, 0.95, 6.0, 0.08, 0.5 / 0.95, 6, (24, 32)),
}


def healthy(shape: Shape, level: float, t: float) -> float:
    """The healthy curve at step `t`: from `shape.start` to `level`, saturating."""
    return level - (level - shape.start) * math.exp(-t / shape.rise_steps)
