"""The rollout side of training, run as one Ray actor: engines, prompt data, generate/reward plugins, eval.

The manager starts the inference engines it needs (the CPU engine server on a CPU machine; SGLang engines behind
SGLang's router on GPU), so they live and die with it. A rollout runs on a worker thread of the actor while the
driver polls `progress()` from another thread to draw its progress bar.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_search.metrics import percentile
from slime_search.types import Sample

logger = logging.getLogger(__name__)


@dataclass
class Engines:
    url: str  # where /generate goes: the one engine, or the router in front of several
    worker_urls: list[str]  # every engine, for weight updates
    processes: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def start_engines(args, log_dir: Path, gpu_ids: list[str] | None = None) -> Engines:
    """SGLang engines + router with --rollout-num-gpus, on the GPUs Ray gave this actor or, colocated, on the
    actor's GPUs (`gpu_ids`, in actor rank order) with SGLang's memory saver; else one CPU engine."""
    from slime_search.utils.server_process import ServerProcess

    if args.engine_url:
        return Engines(args.engine_url, [args.engine_url])
    if args.rollout_num_gpus:
        from slime_search.backends.megatron.distributed import free_port
        from slime_search.rollout import sglang_launch

        specs = sglang_launch.engine_specs(
            args.hf_checkpoint,
            args.rollout_num_gpus,
            args.rollout_num_gpus_per_engine,
            first_port=free_port(),
            mem_fraction_static=args.sglang_mem_fraction_static,
            extra_args=("--enable-memory-saver",) if args.colocate else (),
        )
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else None
        deployment = sglang_launch.launch(specs, "127.0.0.1", args.sglang_router_port or free_port(), env=env)
        return Engines(deployment.router_url, [s.url for s in specs], [deployment])
    command = ["-m", "slime_search.rollout.cpu_engine_server", "--model-path", args.hf_checkpoint, "--port", "0"]
    command += ["--max-batch-size", str(args.engine_max_batch_size), "--seed", str(args.seed)]
    engine = ServerProcess(command, log_path=log_dir / "engine.log")
    return Engines(engine.url, [engine.url], [engine])


def sample_record(sample: Sample, reward_key: str) -> dict[str, Any]:
    """A rollout as the report shows it: prompt, the response split into generated and observed segments."""
    from slime_search.rollout.rollout import reward_value

    return {
        "prompt": sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"],
        "label": sample.label,
        "segments": [[text, generated] for text, generated in sample.segments],
        "reward": reward_value(sample.reward, reward_key) if sample.reward is not None else None,
        "status": sample.status.value,
        "searches": int(sample.metrics.get("searches", 0)),
    }


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """Search behaviour of a rollout: turns, searches, invalid actions, search latency, truncations, versions."""
    n = max(1, len(samples))
    per_search = [
        s.metrics["search_latency_s"] / s.metrics["searches"] for s in samples if s.metrics.get("searches", 0) > 0
    ]
    out = {
        "rollout/turns_mean": sum(s.metrics.get("turns", 0) for s in samples) / n,
        "rollout/searches_mean": sum(s.metrics.get("searches", 0) for s in samples) / n,
        "rollout/search_rate": sum(s.metrics.get("searches", 0) > 0 for s in samples) / n,
        "rollout/invalid_action_rate": sum(s.metrics.get("invalid_actions", 0) > 0 for s in samples) / n,
        "rollout/obs_truncations": float(sum(s.metrics.get("obs_truncations", 0) for s in samples)),
        "rollout/search_failures": float(sum(s.metadata.get("finish_reason") == "search_error" for s in samples)),
    }
    if per_search:
        out["rollout/search_latency_p50_s"] = percentile(per_search, 0.5)
        out["rollout/search_latency_p99_s"] = percentile(per_search, 0.99)
    versions = {v for s in samples for v in s.weight_versions}
    if len(versions) > 1:
        raise RuntimeError(f"a rollout mixed weight versions {sorted(versions)}; engines were updated mid-rollout")
    if versions and next(iter(versions)).isdigit():  # a scripted engine (no weights) may name its version
        out["rollout/weight_version"] = float(versions.pop())
    return out


class RolloutManager:
    def __init__(self, args, gpu_ids: list[str] | None = None):
        from slime_search.plugins import load_function
        from slime_search.rollout.data_source import DataConfig, DataSource

        self.args = args
        self.engines = start_engines(args, Path(args.save), gpu_ids)
        args.engine_url = self.engines.url
        self.generate_fn = load_function(args.custom_generate_function_path)
        self.reward_fn = load_function(args.custom_rm_path)
        data = DataConfig(
            args.prompt_data, args.input_key, args.label_key, shuffle=args.rollout_shuffle, seed=args.rollout_seed
        )
        self.source = DataSource(data)
        self._lock = threading.Lock()
        self._progress = (0, 0)

    # ---- progress (answered from a second thread of the actor while a rollout runs) ----------------------
    def progress(self) -> tuple[int, int]:
        with self._lock:
            return self._progress

    def _count(self, done: int, total: int) -> None:
        with self._lock:
            self._progress = (done, total)

    # ---- rollouts ---------------------------------------------------------------------------------------------
    def _run(self, source, config, params):
        return run_rollout(self.args, source, config, self.generate_fn, self.reward_fn, params, self._count)

    def generate(self, examples: int = 0) -> tuple[list[Any], dict[str, float], list[dict]]:
        """One training rollout: train samples with GRPO advantages, metrics, and `examples` rendered samples."""
        from slime_search.arguments import rollout_config, sampling_params
        from slime_search.rollout.rollout import assign_advantages

        config = rollout_config(self.args)
        groups, metrics = self._run(self.source, config, sampling_params(self.args))
        everything = [s for g in groups for s in g]
        metrics.update(rollout_metrics(everything))
        samples = assign_advantages(everything, config.reward_key, config.normalize_advantages_std)
        shown = [sample_record(s, config.reward_key) for s in everything[:examples]]
        return [to_train_sample(s) for s in samples], metrics, shown

    def evaluate(self, examples: int = 0) -> tuple[dict[str, float], list[dict]]:
        """Greedy decoding of every --eval-prompt-data set; EM / sub-EM / F1 per data source, search rate, turns."""
        from slime_search.arguments import sampling_params
        from slime_search.evaluation import evaluate_samples

        samples = evaluation_samples(self.args, self._run, sampling_params(self.args, greedy=True))
        shown = [sample_record(s, self.args.reward_key) for s in samples[:examples]]
        return evaluate_samples(samples), shown

    # ---- weights and state ---------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str) -> list[str]:
        from slime_search.weight_sync import update_engines_from_disk

        return asyncio.run(update_engines_from_disk(self.engines.worker_urls, model_path, weight_version))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine gives back the memory of `tags` to a colocated trainer (all of it by default)."""
        asyncio.run(on_every_engine(self.engines.worker_urls, "release_memory", tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        asyncio.run(on_every_engine(self.engines.worker_urls, "resume_memory", tags))

    def worker_urls(self) -> list[str]:
        """Every engine's own address (not the router's), for weight updates."""
        return list(self.engines.worker_urls)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["data"])

    def shutdown(self) -> None:
        self.engines.stop()


async def on_every_engine(urls: list[str], method: str, *args) -> None:
    """One EngineClient call on every engine, concurrently. (Module level: an async method would turn the
    RolloutManager into an async Ray actor, whose synchronous methods could not run their own event loops.)"""
    from slime_search.rollout.engine_client import call_engine

    await asyncio.gather(*(call_engine(url, method, *args) for url in urls))


def run_rollout(args, source, config, generate, reward, params: dict, on_sample=None):
    """One rollout in its own event loop; the generate plugin's pooled clients are closed before the loop ends."""
    from slime_search.rollout.rollout import generate_rollout
    from slime_search.search_r1.generate import close_resources

    async def run():
        try:
            return await generate_rollout(args, source, config, generate, reward, params, on_sample=on_sample)
        finally:
            await close_resources()

    return asyncio.run(run())


def evaluation_samples(args, run, params: dict) -> list[Sample]:
    """Every row of every eval set once, greedy; the set's NAME fills in a missing data_source."""
    from slime_search.arguments import rollout_config
    from slime_search.rollout.data_source import DataConfig, DataSource

    samples = []
    for name, path in zip(args.eval_prompt_data[::2], args.eval_prompt_data[1::2], strict=True):
        source = DataSource(DataConfig(path, args.input_key, args.label_key))
        config = rollout_config(args)
        config = type(config)(batch_size=len(source), n_samples_per_prompt=1, reward_key=config.reward_key)
        groups, _ = run(source, config, params)
        for group in groups:
            for sample in group:
                sample.metadata["data_source"] = sample.metadata.get("data_source") or name
                samples.append(sample)
    return samples


def to_train_sample(sample: Sample):
    from slime_search.backends.megatron.loss import TrainSample

    return TrainSample(
        tokens=list(sample.tokens),
        response_length=sample.response_length,
        loss_mask=list(sample.loss_mask),
        advantage=float(sample.metadata.get("advantage", 0.0)),
        rollout_log_probs=list(sample.rollout_log_probs),
    )
