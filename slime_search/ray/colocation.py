"""Who holds the device memory when the engines share the actor's GPUs (--colocate).

Rollout and eval need the engines whole (weights and KV cache) and the actor away; training needs the actor back and the
engines released; a weight push needs the actor in place and the engines' weight memory, not yet their KV cache and CUDA
graphs. Each phase asks for its layout and only the changes are made, in an order that never holds both sides' memory at
once: the side that leaves goes first. Without --colocate every call is a no-op.

Under --lora-sync-from-tensor the engines keep their base weights through training. A push then carries the adapters
alone, and released weights would come back without the base beneath them. SGLang releases each memory tag on its own,
so only the KV cache and the CUDA graphs go to the trainer. The adapters' own buffers are never released by SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class MemoryLayout:
    actor_on_device: bool = True
    engine_weights: bool = True
    engine_kv_cache: bool = True


class Colocation:
    def __init__(self, enabled: bool, group, manager=None, keep_engine_weights: bool = False):
        self.enabled = enabled
        self.keep_engine_weights = keep_engine_weights  # the pushes carry adapters alone: the base must stay
        self.group = group
        self.manager = manager
        self.layout = MemoryLayout()
        self.offloaded_bytes = 0  # what the actor last handed over

    def _engine_tags(self, held: bool) -> list[str]:
        """SGLang's memory tags the engines currently hold (or, with held=False, have given back). CUDA-graph memory
        goes and comes with the KV cache. It is needed for generation only, and an engine would otherwise keep its GBs
        through training. SGLang releases it only when the engine was started with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, as
        colocated engines are (engines.sglang_launch.MEMORY_SAVER_ENV)."""
        tags = {
            "weights": self.layout.engine_weights,
            "kv_cache": self.layout.engine_kv_cache,
            "cuda_graph": self.layout.engine_kv_cache,
        }
        return [tag for tag, on in tags.items() if on == held]

    def _engines(self, method: str, tags: list[str]) -> None:
        import ray

        ray.get(getattr(self.manager, method).remote(tags))

    def for_generation(self) -> None:
        """Actor away, engines whole."""
        if not self.enabled:
            return
        if self.layout.actor_on_device:
            self.offloaded_bytes = self.group.offload()
            logger.info("actor offloaded: %.3f GiB per rank", self.offloaded_bytes / 2**30)
            self.layout.actor_on_device = False
        missing = self._engine_tags(held=False)
        if missing:
            self._engines("resume_memory", missing)
            self.layout.engine_weights = self.layout.engine_kv_cache = True

    def for_training(self) -> None:
        """Engines released (each once it is idle: SGLang exits on a release while a request is running or waiting),
        actor on its device."""
        if not self.enabled:
            return
        held = [tag for tag in self._engine_tags(held=True) if not (tag == "weights" and self.keep_engine_weights)]
        if held:
            self._engines("release_memory", held)
            self.layout.engine_kv_cache = False
            self.layout.engine_weights = self.layout.engine_weights and "weights" not in held
        if not self.layout.actor_on_device:
            self.group.onload()
            self.layout.actor_on_device = True

    def for_weight_push(self) -> None:
        """Actor on its device, engines holding weight memory (their KV cache comes back for generation)."""
        if not self.enabled:
            return
        if not self.layout.actor_on_device:
            self.for_training()
        if not self.layout.engine_weights:
            self._engines("resume_memory", ["weights"])
            self.layout.engine_weights = True

    def metrics(self) -> dict[str, float]:
        return {"memory/actor_offloaded_gib": self.offloaded_bytes / 2**30} if self.enabled else {}
