"""argparse `type=` functions for numeric flags: a value out of range is a usage error that names the flag.

argparse turns the ArgumentTypeError raised here into `error: argument --flag: must be >= 1, got 0` (exit code 2). So a
zero concurrency or a negative timeout is refused when the command line is read. It is not found later as a hang or a
traceback inside a worker.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _checked(convert: Callable[[str], float], kind: str, ok: Callable[[float], bool], rule: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


positive_int = _checked(int, "an integer", lambda v: v >= 1, ">= 1")
non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")
port = _checked(int, "an integer", lambda v: 0 <= v <= 65535, "a port number, 0 to 65535 (0: a free one)")
positive_float = _checked(float, "a number", lambda v: v > 0, "> 0")
non_negative_float = _checked(float, "a number", lambda v: v >= 0, ">= 0")
probability = _checked(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")
below_one = _checked(float, "a number", lambda v: 0 <= v < 1, "in [0, 1)")
fraction = _checked(float, "a number", lambda v: 0 <= v <= 1, "in [0, 1]")
non_positive_float = _checked(float, "a number", lambda v: v <= 0, "<= 0")
