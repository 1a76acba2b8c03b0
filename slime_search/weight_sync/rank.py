"""The trainer rank's half of weight sync, mixed into the rank's Ray actor (`slime_search.ray.train_group.TrainRank`).

A transport on the driver calls every method on every rank at once (`RayTrainGroup.on_all_ranks`). The ranks gather
their tensor-parallel shards together. Then rank 0 (disk, broadcast), or each rank an engine sits on (tensor handles),
hands the result on.
"""

from __future__ import annotations

from pathlib import Path


def release_ipc_memory() -> None:
    """Free the dropped buckets' device memory. Every bucket is a fresh allocation, and torch keeps a block shared by
    CUDA IPC unfreed while an engine still holds its handle; ipc_collect frees the blocks the engines have closed
    and empty_cache hands the memory to colocated engines."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class WeightSyncRank:
    """Needs `rank` (global rank), `actor` (MegatronActor), `shape` (ModelShape), `lora` (LoraConfig) and `base`
    (where the frozen base came from) from the class it is mixed into."""

    broadcaster = None  # rank 0's WeightBroadcaster while connected
    base_only = False  # push the frozen base without the adapters folded in (set_base_only)
    _handle_buckets = None  # the tensor-handle stream of the push in progress
    _sent = None  # the bucket whose handles the engines may still be reading

    def _te_names(self) -> bool:
        from slime_search.backends.megatron.model import uses_te_names

        return uses_te_names(self.actor.model.module)

    def _hf_buckets(self, bucket_bytes: int):
        """The weights under HF names, streamed in buckets (collective over the tensor-parallel group)."""
        from slime_search.weight_sync.gather import iter_hf_buckets

        state = self.actor.local_state_dict(fold_adapters=not self.base_only)
        return iter_hf_buckets(state, self.shape, self._te_names(), bucket_bytes)

    def set_base_only(self, on: bool) -> None:
        """Whether the next pushes carry the frozen base alone: engines that serve the adapters by name
        (--lora-sync-from-tensor) need the actor's base beneath them, once."""
        self.base_only = on

    # ---- disk ---------------------------------------------------------------------------------------------------
    def write_hf(self, original_hf: str, out_dir: str) -> str | None:
        """Rank 0 writes the gathered weights as an HF checkpoint; returns its folder (None on the other ranks)."""
        from slime_search.weight_sync.disk import write_hf_checkpoint
        from slime_search.weight_sync.gather import gather_full_megatron_state

        full = gather_full_megatron_state(self.actor.local_state_dict(fold_adapters=not self.base_only))
        if self.rank != 0:
            return None
        write_hf_checkpoint(full, self.shape, original_hf, out_dir, te_names=self._te_names())
        return out_dir

    def write_hf_streamed(self, original_hf: str, out_dir: str, bucket_bytes: int) -> str | None:
        """Rank 0 writes an HF checkpoint shard by shard as the buckets are gathered (the other ranks help gather),
        into a temporary sibling renamed into place when complete; returns its folder (None on the other ranks).
        Under LoRA the folder holds the weights with the adapters folded in, and the adapters alone as a PEFT
        adapter folder in `adapter/`."""
        import shutil

        from megatron_bridge.hf_io import save_hf_shards
        from slime_search.backends.megatron.lora import full_adapters
        from slime_search.backends.megatron.lora_peft import save_peft_adapter

        adapters = full_adapters(self.actor.model.module) if self.lora.enabled else None  # collective
        buckets = self._hf_buckets(bucket_bytes)
        if self.rank != 0:
            for _ in buckets:
                pass
            return None
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_shards(buckets, Path(original_hf), tmp)
        if adapters is not None:
            save_peft_adapter(tmp / "adapter", adapters, self.shape, self.lora, original_hf)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return out_dir

    # ---- broadcast ------------------------------------------------------------------------------------------------
    def connect_engines(self, engine_urls: list[str], ranks_per_engine: list[int], config) -> None:
        """Rank 0 hosts the weight-update group the engines join (the other ranks only help gather)."""
        import ray

        from slime_search.utils.net import free_port
        from slime_search.weight_sync.broadcast import WeightBroadcaster

        self.broadcast_config = config
        if self.rank != 0:
            return
        self.broadcaster = WeightBroadcaster(config)
        self.broadcaster.connect(engine_urls, ranks_per_engine, ray.util.get_node_ip_address(), free_port())

    def broadcast_weights(self, weight_version: str) -> list[str] | None:
        """Rank 0 broadcasts to every engine as the buckets are gathered; the other ranks help gather."""
        buckets = self._hf_buckets(self.broadcast_config.bucket_bytes)
        try:
            return self.broadcaster.push_buckets(buckets, weight_version) if self.rank == 0 else None
        finally:
            for _ in buckets:  # gather to the end (also after a failed push) so that no rank waits for this one
                pass

    def disconnect_engines(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None

    # ---- the adapters alone (--lora-sync-from-tensor) --------------------------------------------------------------
    def adapter_payload(self) -> tuple[str, dict, int] | None:
        """Collective over the tensor-parallel group: rank 0's adapters under PEFT's names, in host shared memory
        (kept alive until finish_adapter_payload), as one serialized entry, with their adapter_config.json and their
        bytes; None on the other ranks. Host memory reaches an engine on any GPU of this node."""
        from slime_search.backends.megatron.lora import full_adapters
        from slime_search.backends.megatron.lora_peft import peft_adapter_config, peft_adapter_state
        from slime_search.engines.weight_wire import serialize_named_tensors

        adapters = full_adapters(self.actor.model.module)
        if self.rank != 0:
            return None
        state = {name: t.to("cpu", copy=True) for name, t in peft_adapter_state(adapters, self.shape).items()}
        self._sent = state
        config = peft_adapter_config(self.lora, self.base.get("hf_checkpoint") or "")
        return serialize_named_tensors(state), config, sum(t.numel() * t.element_size() for t in state.values())

    def finish_adapter_payload(self) -> None:
        self._sent = None

    # ---- tensor handles -------------------------------------------------------------------------------------------
    def prepare_weight_handles(self, bucket_bytes: int, serving_ranks: int) -> None:
        """Start streaming the weights; ranks below `serving_ranks` have an engine on their device and hand it their
        buckets."""
        from slime_search.weight_sync.broadcast import with_last

        self._handle_buckets = with_last(self._hf_buckets(bucket_bytes))
        self._serves_engine = self.rank < serving_ranks
        self._sent = None

    def next_weight_handles(self) -> tuple[str | None, str | None, bool]:
        """Collective, called once the engines answered for the previous bucket, which is dropped: the next bucket as
        handles (None on a rank without an engine), its load_format, and whether it is the last one."""
        from slime_search.engines.weight_wire import tensor_bucket_payload

        self._sent = None
        release_ipc_memory()
        bucket, last = next(self._handle_buckets)
        if not self._serves_engine:
            return None, None, last
        entry, load_format, self._sent = tensor_bucket_payload(bucket)
        return entry, load_format, last

    def finish_weight_handles(self) -> None:
        self._handle_buckets, self._sent = None, None
        release_ipc_memory()
