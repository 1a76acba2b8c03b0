"""One colocated hand-over of an actor's state, measured on its device."""

from __future__ import annotations

import time


def handover(actor) -> dict:
    """One hand-over of the actor's weights, gradients and optimizer state to host memory and back: bytes, device
    memory before and while handed over (GiB), seconds each way."""
    import torch

    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    start = time.perf_counter()
    handed = actor.offload()
    offload_s = time.perf_counter() - start
    left = torch.cuda.memory_allocated()
    start = time.perf_counter()
    actor.onload()
    torch.cuda.synchronize()
    return {
        "gib_handed": round(handed / 2**30, 2),
        "device_gib_before": round(held / 2**30, 2),
        "device_gib_while_offloaded": round(left / 2**30, 2),
        "offload_s": round(offload_s, 2),
        "onload_s": round(time.perf_counter() - start, 2),
    }
