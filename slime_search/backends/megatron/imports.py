"""Megatron-core imported with its fused functions compiled when first called rather than when decorated.

Megatron-core decorates its fused functions (bias-GeLU, bias-SwiGLU, bias-dropout-add, ...) with `torch.compile` at
import. Decorating imports TorchDynamo and Inductor. That costs seconds of CPU (docs/benchmarks/test_suite.md) in every
process that imports Megatron, and more at exit. Each rank of every run pays it, although the CPU recipe calls no fused
function. `torch.compile` compiles on the first call anyway. So deferring the decoration to that call changes only when
the compiler is imported. A fused function that does run is compiled exactly as before, with the same arguments.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `torch.compile` (`compile_fn`) that defers it: for a plain function it returns a wrapper that
    calls `compile_fn(function, **options)` on the wrapper's first call and the compiled function from then on.
    Anything else (a module, or no function yet with options given) goes to `compile_fn` at once, unchanged."""

    def deferred(model=None, **options):
        if model is None:
            return lambda function: deferred(function, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def import_megatron_core() -> None:
    """Import `megatron.core` (once per process) with `torch.compile` deferred during the import only; afterwards
    `torch.compile` is the real one again. Does nothing when Megatron-core is imported already."""
    if "megatron.core" in sys.modules:
        return
    import torch

    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        import megatron.core  # noqa: F401  (the import is the point)
    finally:
        torch.compile = real
