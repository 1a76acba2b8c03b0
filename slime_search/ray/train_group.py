"""A group of Ray actors, one per Megatron rank, placed by a placement group and driven as one trainer.

Rank r holds tensor-parallel rank r % TP of data-parallel rank r // TP (Megatron's order with TP innermost);
every TP rank of a data-parallel group receives that group's samples. On a CPU machine the bundles ask for
CPU only and the ranks talk over gloo; on GPU each bundle holds one GPU and the ranks use NCCL. A rank also serves
its half of weight sync (`slime_search.weight_sync.rank`), which the transports call through `on_all_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_search.config.lora import LoraConfig
from slime_search.types import TrainSample
from slime_search.utils.actor_logging import log_to_run_folder
from slime_search.weight_sync.rank import WeightSyncRank


@dataclass(frozen=True)
class TrainGroupConfig:
    num_ranks: int
    tp_size: int = 1
    use_gpu: bool = False
    cpus_per_rank: float = 0.5
    seed: int = 1234  # --seed: every rank's RNGs (Megatron's model-parallel RNG adds the TP rank)
    log_dir: str = ""  # the run folder: each rank logs to train_rank_N.log there ("": no log file)

    @property
    def dp_size(self) -> int:
        if self.num_ranks % self.tp_size:
            raise ValueError(f"{self.num_ranks} ranks are not a multiple of tensor-parallel size {self.tp_size}")
        return self.num_ranks // self.tp_size


@dataclass(frozen=True)
class ModelSource:
    """Where the actor's (and the KL reference's) architecture and weights come from."""

    hf_checkpoint: str  # architecture, tokenizer, and the initial weights unless `load` is given
    load: str | None = None  # torch_dist folder with the initial actor weights
    with_reference: bool = False  # also load the frozen KL reference
    ref_load: str | None = None  # torch_dist folder of the reference (else the initial actor weights)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # options beyond config.json (dtype, SP)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters on the actor, its base frozen (--lora-rank)

    @property
    def needs_first_push(self) -> bool:
        """Whether the engines need a push before the first rollout.

        The engines start on the HF folder's weights. They need a push when the actor starts elsewhere (--load,
        --lora-adapter-path), or when they serve the policy as an adapter that only a push loads
        (--lora-sync-from-tensor)."""
        return self.load is not None or self.lora.lora_adapter_path is not None or self.lora.lora_sync_from_tensor


def create_placement_group(config: TrainGroupConfig):
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": config.cpus_per_rank, **({"GPU": 1} if config.use_gpu else {})}
    group = placement_group([dict(bundle) for _ in range(config.num_ranks)], strategy="PACK")
    ray.get(group.ready())
    return group


def reduce_over_data_parallel(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from each data-parallel rank's. A rank reports its share of every global-batch quantity,
    normalised by the global token and sequence counts, so the shares add up. A few values it reports whole
    (`REPLICATED_METRICS`): the gradient norm, whether the step was applied, and what the ranks all-reduced themselves.
    """
    from slime_search.backends.megatron.actor import REPLICATED_METRICS

    out: dict[str, float] = {}
    for name in dict.fromkeys(name for metrics in per_rank for name in metrics):
        values = [metrics[name] for metrics in per_rank if name in metrics]  # a rank with no sample has no share
        out[name] = values[0] if name in REPLICATED_METRICS else sum(values)
    return out


def split_into_steps(samples: list, steps: int) -> list[list]:
    """`steps` consecutive parts as equal as can be (the first ones one longer): every sample is trained on."""
    if steps <= 0:
        raise ValueError(f"optimizer steps per rollout must be > 0, got {steps}")
    size, extra = divmod(len(samples), steps)
    parts, start = [], 0
    for k in range(steps):
        stop = start + size + (1 if k < extra else 0)
        parts.append(samples[start:stop])
        start = stop
    return parts


def split_for_data_parallel(samples: list, dp_size: int) -> list[list]:
    """Longest sample first onto the rank with the fewest tokens so far: balanced work per rank. With fewer samples
    than ranks some ranks get none. They still take part in every collective, their share of the loss 0. So a rollout
    that lost most of its samples trains on what is left."""
    if dp_size <= 0:
        raise ValueError(f"data-parallel size must be > 0, got {dp_size}")
    shards: list[list] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for sample in sorted(samples, key=lambda s: -len(s.tokens)):
        rank = min(range(dp_size), key=lambda r: (loads[r], len(shards[r])))
        shards[rank].append(sample)
        loads[rank] += len(sample.tokens)
    return shards


# SGLang sets NCCL_CUMEM_ENABLE=0 in its engines; the trainer's end of the NCCL weight-update group must use the same
# memory mode, or the first broadcast between them fails in NCCL's IPC set-up. One CUDA connection (hardware queue)
# per device keeps kernels in launch order, which Megatron's overlap of its tensor-parallel collectives (all-gather,
# reduce-scatter, all-reduce) with the backward pass's gradient GEMMs relies on (tensor_parallel/layers.py).
RANK_ENV = {"NCCL_CUMEM_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def rank_options(config: TrainGroupConfig) -> dict[str, Any]:
    """Ray actor options of one rank (its bundle comes with the scheduling strategy)."""
    return {
        "num_cpus": config.cpus_per_rank,
        "num_gpus": 1 if config.use_gpu else 0,
        "runtime_env": {"env_vars": dict(RANK_ENV)},
    }


def mean_step_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps of one rollout as one record: means under train/, the largest gradient norm and the number
    of steps applied (a refused update is a count the guard reads, not a fraction)."""
    out: dict[str, float] = {}
    for name in {name for step in history for name in step}:
        values = [step[name] for step in history if name in step]
        out[f"train/{name}"] = sum(values) / len(values)
    norms = [step["grad_norm"] for step in history if "grad_norm" in step]
    if norms:
        out["train/grad_norm_max"] = max(norms, key=lambda n: n if n == n else float("inf"))  # a NaN wins
    out["train/steps_applied"] = float(sum(step.get("step_applied", 0.0) for step in history))
    out["train/steps"] = float(len(history))
    return out


class TrainRank(WeightSyncRank):
    """One Megatron rank inside a Ray actor (wrapped by ray.remote in RayTrainGroup)."""

    def __init__(self, rank: int, world_size: int, tp_size: int, log_dir: str = ""):
        import os

        import torch

        if log_dir:
            log_to_run_folder(log_dir, f"train_rank_{rank}")
        if not torch.cuda.is_available():  # Ray sets one thread for fractional-CPU actors; share the cores instead
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.rank, self.world_size, self.tp_size = rank, world_size, tp_size
        self.actor = None
        self.reference = None
        self.shape = None
        self.lora = LoraConfig()
        self.base: dict[str, str | None] = {}  # where the frozen base's weights came from (a LoRA checkpoint's record)

    def rendezvous_address(self) -> tuple[str, int]:
        """This rank's node address and a port free there: rank 0 hosts the process group's rendezvous."""
        import ray

        from slime_search.utils.net import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, master_address: str, master_port: int, seed: int = 1234) -> None:
        from slime_search.backends.megatron.distributed import init_megatron

        init_megatron(self.rank, self.world_size, self.tp_size, master_port, master_address, seed=seed)

    def distributed_address(self) -> tuple[str, int]:
        """Where this rank's process group met, and its size."""
        import os

        import torch.distributed as dist

        return os.environ["MASTER_ADDR"], dist.get_world_size()

    def _build(self, hf_checkpoint: str, weights_from: str | None, model_overrides: dict):
        """A model with the HF checkpoint's architecture; weights from the HF folder, or a torch_dist folder."""
        from transformers import AutoConfig

        from megatron_bridge import ModelShape
        from megatron_bridge.hf_io import read_hf_state
        from slime_search.backends.megatron.checkpoint import load_model
        from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

        hf_config = AutoConfig.from_pretrained(hf_checkpoint)
        self.shape = ModelShape.from_hf_config(hf_config)
        options = ModelOptions.from_hf_config(hf_config, **model_overrides)
        model = build_gpt_model(self.shape, options)
        if weights_from is None:
            load_hf_weights(model, read_hf_state(hf_checkpoint), self.shape, options)
        else:
            load_model(model, weights_from)
        return model

    def load_models(self, source: ModelSource, actor_config) -> str:
        """The actor, initialised from the HF checkpoint or `source.load` (with LoRA's adapters on it); the KL
        reference if asked for: under LoRA the actor with its adapters disabled (its frozen base is the initial
        weights), unless --ref-load names other weights than --load. Returns what the actor holds on this rank."""
        from slime_search.backends.megatron.actor import AdapterOffReference, MegatronActor, ReferenceModel
        from slime_search.backends.megatron.lora import apply_lora
        from slime_search.backends.megatron.lora_peft import load_peft_adapters

        model = self._build(source.hf_checkpoint, source.load, source.model_overrides)
        apply_lora(model, source.lora)  # before the optimizer and the gradient buffers: only adapters train
        if source.lora.lora_adapter_path:  # a resume loads the checkpoint's adapters over these
            load_peft_adapters(model, source.lora.lora_adapter_path, source.lora, self.shape)
        self.lora = source.lora
        self.base = {"hf_checkpoint": source.hf_checkpoint, "load": source.load}
        self.actor = MegatronActor(model, actor_config)
        if source.with_reference and source.lora.enabled and source.ref_load in (None, source.load):
            self.reference = AdapterOffReference(self.actor)
        elif source.with_reference:
            reference = self._build(source.hf_checkpoint, source.ref_load or source.load, source.model_overrides)
            self.reference = ReferenceModel(reference, actor_config)
        return self.memory_plan(actor_config)

    def memory_plan(self, actor_config) -> str:
        """What the actor (and the KL reference) hold on this rank, in a line for the driver's log."""
        from megatron.core import parallel_state

        from slime_search.backends.megatron.actor import ReferenceModel
        from slime_search.backends.megatron.memory import GIB, actor_memory

        shards = parallel_state.get_data_parallel_world_size() if actor_config.optim.use_distributed_optimizer else 1
        line = f"actor rank {self.rank} holds {actor_memory(self.actor.model.module, shards).describe()}"
        if isinstance(self.reference, ReferenceModel):
            line += f"; the KL reference {actor_memory(self.reference.model).weight_bytes / GIB:.2f} GiB more"
        elif self.reference is not None:
            line += "; the KL reference is its base, adapters off (no copy)"
        return line

    def compute_ref_log_probs(self, samples) -> list[list[float]]:
        return self.reference.compute_log_probs(samples)

    def compute_log_probs(self, samples) -> list[list[float]]:
        return self.actor.compute_log_probs(samples)

    def sequence_log_probs(self, token_ids: list[int]) -> list[float]:
        return self.actor.sequence_log_probs(token_ids)

    def train_step(self, samples, skip_above: float | None = None) -> dict[str, float]:
        return self.actor.train_step(samples, skip_above)

    def set_lr_scale(self, scale: float) -> None:
        self.actor.optimizer.lr_scale = scale

    def save(self, root: str, iteration: int, extra_files: dict[str, str] | None = None) -> None:
        from slime_search.backends.megatron.checkpoint import save_actor
        from slime_search.backends.megatron.lora import LORA_RECORD, lora_record

        if self.lora.enabled:  # what tools/convert_lora_to_hf.py needs to rebuild the model the adapters sit on
            extra_files = {**(extra_files or {}), LORA_RECORD: lora_record(self.lora, **self.base)}
        save_actor(self.actor, root, iteration, extra_files)

    def load(self, root: str, iteration: int | None = None) -> int:
        from slime_search.backends.megatron.checkpoint import load_actor

        return load_actor(self.actor, root, iteration)

    def checkpoint_parameters(self) -> tuple[int, int, int, int]:
        """(tensor-parallel rank, parameters held, own share of the global model, bytes per parameter) of the actor."""
        from megatron.core import parallel_state

        from slime_search.backends.megatron.checkpoint_size import rank_parameters

        model = self.actor.model.module
        held, own = rank_parameters(model)
        return parallel_state.get_tensor_model_parallel_rank(), held, own, next(model.parameters()).element_size()

    def offload(self) -> int:
        """Give the device memory of the actor (and the KL reference) to colocated engines; returns bytes."""
        return sum(model.offload() for model in (self.actor, self.reference) if model is not None)

    def onload(self) -> int:
        return sum(model.onload() for model in (self.actor, self.reference) if model is not None)

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


class RayTrainGroup:
    def __init__(self, config: TrainGroupConfig, placement_group=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.with_reference = False
        self.placement_group = placement_group or create_placement_group(config)
        remote = ray.remote(TrainRank)
        self.ranks = [
            remote.options(
                **rank_options(config),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(r, config.num_ranks, config.tp_size, config.log_dir)
            for r in range(config.num_ranks)
        ]
        # the rendezvous is on rank 0's node, wherever the placement group put it (another node than the driver's)
        self.master_address, port = ray.get(self.ranks[0].rendezvous_address.remote())
        self.on_all_ranks("init_distributed", self.master_address, port, config.seed)

    def on_all_ranks(self, method: str, *args) -> list[Any]:
        """`method(*args)` on every rank at once; the answers in rank order."""
        import ray

        return ray.get([getattr(rank, method).remote(*args) for rank in self.ranks])

    def _on_data_shards(self, method: str, shards: list[list[Any]]) -> list[Any]:
        """`method(shard)` on every rank, each TP rank of a data-parallel group with that group's shard."""
        import ray

        if len(shards) != self.config.dp_size:
            raise ValueError(f"{len(shards)} data shards for {self.config.dp_size} data-parallel ranks")
        per_rank = [shards[r // self.config.tp_size] for r in range(self.config.num_ranks)]
        return ray.get([getattr(rank, method).remote(data) for rank, data in zip(self.ranks, per_rank, strict=True)])

    def load_models(self, source: ModelSource, actor_config) -> str:
        """Loads every rank's models; returns what rank 0 holds (weights, gradients, optimizer state)."""
        held = self.on_all_ranks("load_models", source, actor_config)
        self.with_reference = source.with_reference
        return held[0]

    def _log_probs(self, method: str, shards: list[list[Any]]) -> list[list[list[float]]]:
        results = self._on_data_shards(method, shards)
        return [results[d * self.config.tp_size] for d in range(self.config.dp_size)]

    def compute_log_probs(self, shards: list[list[Any]]) -> list[list[list[float]]]:
        """Per data-parallel shard, the policy's log-probs (from the shard's first TP rank)."""
        return self._log_probs("compute_log_probs", shards)

    def trainer_log_probs(self, token_ids: list[int]) -> list[float]:
        """The actor's log-probs of token_ids[1:], each given the tokens before it, at temperature 1 (as an engine's
        input log-probs are): the trainer's half of the probe of the engines. Every rank computes them (the
        tensor-parallel ranks together); rank 0's answer."""
        return self.on_all_ranks("sequence_log_probs", list(token_ids))[0]

    def compute_ref_log_probs(self, shards: list[list[Any]]) -> list[list[list[float]]]:
        """Per data-parallel shard, the reference model's log-probs."""
        return self._log_probs("compute_ref_log_probs", shards)

    def train_step(self, shards: list[list[Any]], skip_above: float | None = None) -> dict[str, float]:
        """One optimizer step; the metrics of the whole batch (reduced over the data-parallel ranks)."""
        import ray

        if len(shards) != self.config.dp_size:
            raise ValueError(f"{len(shards)} data shards for {self.config.dp_size} data-parallel ranks")
        tp = self.config.tp_size
        results = ray.get([rank.train_step.remote(shards[r // tp], skip_above) for r, rank in enumerate(self.ranks)])
        return reduce_over_data_parallel([results[d * tp] for d in range(self.config.dp_size)])

    def prepare(self, samples: list[TrainSample]) -> None:
        """The policy's log-probs before any step (PPO's old policy) and, with a reference, the reference's, set on
        every sample of the rollout."""
        shards = split_for_data_parallel(samples, self.config.dp_size)
        for shard, log_probs in zip(shards, self.compute_log_probs(shards), strict=True):
            for sample, values in zip(shard, log_probs, strict=True):
                sample.old_log_probs = values
        if self.with_reference:
            for shard, log_probs in zip(shards, self.compute_ref_log_probs(shards), strict=True):
                for sample, values in zip(shard, log_probs, strict=True):
                    sample.ref_log_probs = values

    def optimize(self, samples: list[TrainSample], steps: int, skip_above: float | None = None) -> dict[str, float]:
        """`steps` optimizer steps on consecutive parts of the prepared rollout, as equal as can be; returns the
        steps' mean metrics under train/ (the largest gradient norm as train/grad_norm_max, the steps applied as a
        count). An update whose gradient norm is not finite or above `skip_above` is not applied."""
        parts = split_into_steps(samples, steps)
        return mean_step_metrics(
            [self.train_step(split_for_data_parallel(part, self.config.dp_size), skip_above) for part in parts]
        )

    def train(self, samples: list[TrainSample], steps: int, skip_above: float | None = None) -> dict[str, float]:
        """`prepare`, then `optimize`."""
        self.prepare(samples)
        return self.optimize(samples, steps, skip_above)

    def set_lr_scale(self, scale: float) -> None:
        """Every rank's learning rate from now on is the schedule's times `scale` (a rollback's remedy)."""
        self.on_all_ranks("set_lr_scale", scale)

    def save(self, root: str, iteration: int, extra_files: dict[str, str] | None = None) -> None:
        """A checkpoint of every rank, with `extra_files` (name -> text) beside it; complete or absent."""
        self.on_all_ranks("save", root, iteration, extra_files)

    def load(self, root: str, iteration: int | None = None) -> int:
        """Every rank loads the checkpoint of `iteration` (the tracked one by default)."""
        return self.on_all_ranks("load", root, iteration)[0]

    def checkpoint_layout(self):
        """The actor's CheckpointLayout (what one checkpoint of it holds), from its ranks as built."""
        from slime_search.backends.megatron.checkpoint_size import layout_of_ranks

        per_rank = self.on_all_ranks("checkpoint_parameters")
        return layout_of_ranks([(tp, held, own) for tp, held, own, _ in per_rank], per_rank[0][3])

    def offload(self) -> int:
        """Every rank gives its device memory to colocated engines; returns the bytes released on rank 0."""
        return self.on_all_ranks("offload")[0]

    def onload(self) -> int:
        return self.on_all_ranks("onload")[0]

    def gpu_ids(self) -> list[str]:
        """The GPUs of the ranks in rank order (physical ids, as CUDA_VISIBLE_DEVICES takes them)."""
        return [i for ids in self.on_all_ranks("gpu_ids") for i in ids]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement_group)
