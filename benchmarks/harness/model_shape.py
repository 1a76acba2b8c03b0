"""The shape of a benchmarked model, as flags."""

from __future__ import annotations

import argparse


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmarked model's shape; Qwen2.5-0.5B's by default."""
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--num-heads", type=int, default=14)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=4864)
