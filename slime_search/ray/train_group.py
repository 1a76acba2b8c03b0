"""A group of Ray actors, one per Megatron rank, placed by a placement group and driven as one trainer.

Rank r holds tensor-parallel rank r % TP of data-parallel rank r // TP (Megatron's order with TP innermost);
every TP rank of a data-parallel group receives that group's samples. On a CPU machine the bundles ask for
CPU only and the ranks talk over gloo; on GPU each bundle holds one GPU and the ranks use NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainGroupConfig:
    num_ranks: int
    tp_size: int = 1
    use_gpu: bool = False
    cpus_per_rank: float = 0.5

    @property
    def dp_size(self) -> int:
        if self.num_ranks % self.tp_size:
            raise ValueError(f"{self.num_ranks} ranks are not a multiple of tensor-parallel size {self.tp_size}")
        return self.num_ranks // self.tp_size


def create_placement_group(config: TrainGroupConfig):
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": config.cpus_per_rank, **({"GPU": 1} if config.use_gpu else {})}
    group = placement_group([dict(bundle) for _ in range(config.num_ranks)], strategy="PACK")
    ray.get(group.ready())
    return group


def release_ipc_memory() -> None:
    """Free the dropped buckets' device memory. Every bucket is a fresh allocation, and torch keeps a block shared by
    CUDA IPC unfreed while an engine still holds its handle; ipc_collect frees the blocks the engines have closed
    and empty_cache hands the memory to colocated engines."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class TrainRank:
    """One Megatron rank inside a Ray actor (wrapped by ray.remote in RayTrainGroup)."""

    def __init__(self, rank: int, world_size: int, tp_size: int, master_port: int):
        import os

        import torch

        from slime_search.backends.megatron.distributed import init_megatron

        if not torch.cuda.is_available():  # Ray sets one thread for fractional-CPU actors; share the cores instead
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_megatron(rank, world_size, tp_size=tp_size, master_port=master_port)
        self.rank = rank
        self.actor = None
        self.reference = None
        self.shape = None

    def _build(self, hf_checkpoint: str, weights_from: str | None, model_overrides: dict):
        """A model with the HF checkpoint's architecture; weights from the HF folder, or a torch_dist folder."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from megatron_bridge import Qwen2Shape
        from slime_search.backends.megatron.checkpoint import load_model
        from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

        hf_config = AutoConfig.from_pretrained(hf_checkpoint)
        self.shape = Qwen2Shape.from_hf_config(hf_config)
        options = ModelOptions.from_hf_config(hf_config, **model_overrides)
        model = build_gpt_model(self.shape, options)
        if weights_from is None:
            hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32)
            load_hf_weights(model, hf.state_dict(), self.shape, options)
        else:
            load_model(model, weights_from)
        return model

    def load_hf(
        self, hf_checkpoint: str, actor_config, load: str | None = None, model_overrides: dict | None = None
    ) -> None:
        """The actor, initialised from the HF checkpoint or, with `load`, from a torch_dist checkpoint."""
        from slime_search.backends.megatron.actor import MegatronActor

        self.actor = MegatronActor(self._build(hf_checkpoint, load, model_overrides or {}), actor_config)

    def load_reference(
        self, hf_checkpoint: str, actor_config, ref_load: str | None = None, model_overrides: dict | None = None
    ) -> None:
        """The frozen reference policy for the KL term: `--ref-load` (torch_dist) or the HF weights."""
        from slime_search.backends.megatron.actor import ReferenceModel

        self.reference = ReferenceModel(self._build(hf_checkpoint, ref_load, model_overrides or {}), actor_config)

    def compute_ref_log_probs(self, samples) -> list[list[float]]:
        return self.reference.compute_log_probs(samples)

    def compute_log_probs(self, samples) -> list[list[float]]:
        return self.actor.compute_log_probs(samples)

    def train_step(self, samples) -> dict[str, float]:
        return self.actor.train_step(samples)

    def save(self, root: str, iteration: int) -> None:
        from slime_search.backends.megatron.checkpoint import save_actor

        save_actor(self.actor, root, iteration)

    def load(self, root: str) -> int:
        from slime_search.backends.megatron.checkpoint import load_actor

        return load_actor(self.actor, root)

    def write_hf(self, original_hf: str, out_dir: str) -> str | None:
        from slime_search.backends.megatron.model import uses_te_names
        from slime_search.weight_sync import gather_full_megatron_state, write_hf_checkpoint

        full = gather_full_megatron_state(self.actor.local_state_dict())
        if self.rank != 0:
            return None
        write_hf_checkpoint(full, self.shape, original_hf, out_dir, te_names=uses_te_names(self.actor.model.module))
        return out_dir

    def connect_engines(self, engine_urls: list[str], ranks_per_engine: list[int], config) -> None:
        """Rank 0 hosts the weight-update group the engines join (the other ranks only help gather)."""
        import ray

        from slime_search.backends.megatron.distributed import free_port
        from slime_search.weight_broadcast import WeightBroadcaster

        self.broadcast_config = config
        if self.rank != 0:
            return
        self.broadcaster = WeightBroadcaster(config)
        self.broadcaster.connect(engine_urls, ranks_per_engine, ray.util.get_node_ip_address(), free_port())

    def offload(self) -> int:
        """Give the device memory of the actor (and the KL reference) to colocated engines; returns bytes."""
        return sum(model.offload() for model in (self.actor, self.reference) if model is not None)

    def onload(self) -> int:
        return sum(model.onload() for model in (self.actor, self.reference) if model is not None)

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def _hf_buckets(self, bucket_bytes: int):
        """The weights under HF names, streamed in buckets (collective over the tensor-parallel group)."""
        from slime_search.backends.megatron.model import uses_te_names
        from slime_search.weight_sync import iter_hf_buckets

        te_names = uses_te_names(self.actor.model.module)
        return iter_hf_buckets(self.actor.local_state_dict(), self.shape, te_names, bucket_bytes)

    def broadcast_weights(self, weight_version: str) -> list[str] | None:
        """Rank 0 broadcasts to every engine as the buckets are gathered; the other ranks help gather."""
        buckets = self._hf_buckets(self.broadcast_config.bucket_bytes)
        try:
            return self.broadcaster.push_buckets(buckets, weight_version) if self.rank == 0 else None
        finally:
            for _ in buckets:  # gather to the end (also after a failed push) so that no rank waits for this one
                pass

    def prepare_weight_handles(self, bucket_bytes: int, serving_ranks: int) -> None:
        """Tensor-handle sync, step 1: start streaming the weights; ranks below `serving_ranks` have an engine
        on their device and hand it their buckets."""
        from slime_search.weight_broadcast import with_last

        self._handle_buckets = with_last(self._hf_buckets(bucket_bytes))
        self._serves_engine = self.rank < serving_ranks
        self._sent = None

    def next_weight_handles(self) -> tuple[str | None, bool]:
        """Step 2 (collective), called once the engines answered for the previous bucket, which is dropped: the
        next bucket as handles (None on a rank without an engine) and whether it is the last one."""
        from slime_search.weight_ipc import serialize_named_tensors

        self._sent = None
        release_ipc_memory()
        self._sent, last = next(self._handle_buckets)
        return (serialize_named_tensors(self._sent) if self._serves_engine else None), last

    def finish_weight_handles(self) -> None:
        self._handle_buckets, self._sent = None, None
        release_ipc_memory()

    def disconnect_engines(self) -> None:
        if getattr(self, "broadcaster", None) is not None:
            self.broadcaster.close()
            self.broadcaster = None


class RayTrainGroup:
    def __init__(self, config: TrainGroupConfig, placement_group=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime_search.backends.megatron.distributed import free_port

        self.config = config
        self.placement_group = placement_group or create_placement_group(config)
        remote = ray.remote(TrainRank)
        port = free_port()
        self.ranks = [
            remote.options(
                num_cpus=config.cpus_per_rank,
                num_gpus=1 if config.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(r, config.num_ranks, config.tp_size, port)
            for r in range(config.num_ranks)
        ]

    def _per_rank(self, shards: list[list[Any]]) -> list[list[Any]]:
        if len(shards) != self.config.dp_size:
            raise ValueError(f"{len(shards)} data shards for {self.config.dp_size} data-parallel ranks")
        return [shards[r // self.config.tp_size] for r in range(self.config.num_ranks)]

    def load_hf(
        self, hf_checkpoint: str, actor_config, load: str | None = None, model_overrides: dict | None = None
    ) -> None:
        import ray

        ray.get([rank.load_hf.remote(hf_checkpoint, actor_config, load, model_overrides) for rank in self.ranks])

    def load_reference(
        self, hf_checkpoint: str, actor_config, ref_load: str | None = None, model_overrides: dict | None = None
    ) -> None:
        import ray

        ray.get(
            [rank.load_reference.remote(hf_checkpoint, actor_config, ref_load, model_overrides) for rank in self.ranks]
        )

    def _log_probs(self, method: str, shards: list[list[Any]]) -> list[list[list[float]]]:
        import ray

        pairs = zip(self.ranks, self._per_rank(shards), strict=True)
        results = ray.get([getattr(rank, method).remote(data) for rank, data in pairs])
        return [results[d * self.config.tp_size] for d in range(self.config.dp_size)]

    def compute_log_probs(self, shards: list[list[Any]]) -> list[list[list[float]]]:
        """Per data-parallel shard, the policy's log-probs (from the shard's first TP rank)."""
        return self._log_probs("compute_log_probs", shards)

    def compute_ref_log_probs(self, shards: list[list[Any]]) -> list[list[list[float]]]:
        """Per data-parallel shard, the reference model's log-probs."""
        return self._log_probs("compute_ref_log_probs", shards)

    def train_step(self, shards: list[list[Any]]) -> dict[str, float]:
        """One optimizer step; returns rank 0's metrics with the loss summed over data-parallel ranks."""
        import ray

        results = ray.get(
            [rank.train_step.remote(data) for rank, data in zip(self.ranks, self._per_rank(shards), strict=True)]
        )
        metrics = dict(results[0])
        metrics["loss"] = sum(results[d * self.config.tp_size]["loss"] for d in range(self.config.dp_size))
        return metrics

    def save(self, root: str, iteration: int) -> None:
        import ray

        ray.get([rank.save.remote(root, iteration) for rank in self.ranks])

    def load(self, root: str) -> int:
        import ray

        return ray.get([rank.load.remote(root) for rank in self.ranks])[0]

    def write_hf(self, original_hf: str, out_dir: str) -> str:
        import ray

        return ray.get([rank.write_hf.remote(original_hf, out_dir) for rank in self.ranks])[0]

    def connect_engines(self, engine_urls: list[str], ranks_per_engine: list[int], config) -> None:
        """Set up broadcast weight sync (`slime_search.weight_broadcast`) from rank 0 to these engines."""
        import ray

        ray.get([rank.connect_engines.remote(engine_urls, ranks_per_engine, config) for rank in self.ranks])

    def broadcast_weights(self, weight_version: str) -> list[str]:
        """Push the current weights to every engine; returns the versions the engines report."""
        import ray

        return ray.get([rank.broadcast_weights.remote(weight_version) for rank in self.ranks])[0]

    def disconnect_engines(self) -> None:
        import ray

        ray.get([rank.disconnect_engines.remote() for rank in self.ranks])

    def offload(self) -> int:
        """Every rank gives its device memory to colocated engines; returns the bytes released on rank 0."""
        import ray

        return ray.get([rank.offload.remote() for rank in self.ranks])[0]

    def onload(self) -> int:
        import ray

        return ray.get([rank.onload.remote() for rank in self.ranks])[0]

    def gpu_ids(self) -> list[str]:
        """The GPUs of the ranks in rank order (physical ids, as CUDA_VISIBLE_DEVICES takes them)."""
        import ray

        return [i for ids in ray.get([rank.gpu_ids.remote() for rank in self.ranks]) for i in ids]

    def prepare_weight_handles(self, bucket_bytes: int, serving_ranks: int) -> None:
        """Tensor-handle sync (`slime_search.weight_ipc`): the first `serving_ranks` ranks serve engines."""
        import ray

        if serving_ranks > self.config.num_ranks:
            raise ValueError(f"engines sit on {serving_ranks} trainer ranks but there are {self.config.num_ranks}")
        ray.get([rank.prepare_weight_handles.remote(bucket_bytes, serving_ranks) for rank in self.ranks])

    def next_weight_handles(self) -> tuple[list[str | None], bool]:
        """The next bucket's handles from every rank, and whether it is the last bucket."""
        import ray

        answers = ray.get([rank.next_weight_handles.remote() for rank in self.ranks])
        lasts = {last for _, last in answers}
        if len(lasts) != 1:
            raise RuntimeError("trainer ranks disagree on where the weights end; their models differ")
        return [entry for entry, _ in answers], lasts.pop()

    def finish_weight_handles(self) -> None:
        import ray

        ray.get([rank.finish_weight_handles.remote() for rank in self.ranks])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement_group)
