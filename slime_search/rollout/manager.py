"""The rollout side of training, run as one Ray actor: engines, prompt data, generate/reward plugins, eval.

The manager starts the inference engines it needs (slime_search.engines.deployment), so they live and die with it.
It takes its typed configuration, built once by the driver, and the parsed flags, which it hands to the plugins
(slime's plugin contract) together with the address of its engines. A rollout runs on a worker thread of the actor
while the driver polls `progress()` from another thread to draw its progress bar.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slime_search.engines.deployment import EngineConfig
from slime_search.metrics import percentile
from slime_search.plugins import Plugins
from slime_search.rollout.data_source import DataConfig, DataSource
from slime_search.rollout.rollout import RolloutConfig, reward_value
from slime_search.types import Sample, TrainSample


@dataclass(frozen=True)
class RolloutManagerConfig:
    engines: EngineConfig
    data: DataConfig  # the training prompts
    rollout: RolloutConfig
    generate_path: str  # --custom-generate-function-path
    reward_path: str  # --custom-rm-path
    sampling_params: dict[str, Any] = field(default_factory=dict)  # training rollouts
    eval_sampling_params: dict[str, Any] = field(default_factory=dict)  # evaluation (greedy)
    eval_sets: tuple[tuple[str, str], ...] = ()  # (name, path) of every --eval-prompt-data set
    log_dir: str = "."  # where the engines' logs go


def plugin_args_for(args: Any, engines) -> argparse.Namespace:
    """What the plugins receive as `args`: the parsed flags, one address for /generate (`engine_url`: the router in
    front of several engines, or the one engine) and every engine's own (`engine_urls`, for a plugin that spreads its
    trajectories over them); a new namespace: the parsed flags themselves are never changed."""
    return argparse.Namespace(**{**vars(args), "engine_url": engines.url, "engine_urls": list(engines.worker_urls)})


def sample_record(sample: Sample, reward_key: str) -> dict[str, Any]:
    """A rollout as the report shows it: prompt, the response split into generated and observed segments."""
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
        "rollout/engine_errors": float(sum(s.metadata.get("finish_reason") == "engine_error" for s in samples)),
        "rollout/engine_failovers": float(sum(s.metrics.get("engine_failovers", 0) for s in samples)),
    }
    billed = sum(s.metrics.get("search_billed", 0) for s in samples)
    hits = sum(s.metrics.get("search_cache_hits", 0) for s in samples)
    if billed or hits:  # web search: what the rollout cost and what a cache saved
        out["rollout/search_billed_calls"] = float(billed)
        out["rollout/search_cache_hits"] = float(hits)
        out["rollout/search_cache_hit_rate"] = hits / (billed + hits)
    if per_search:
        out["rollout/search_latency_p50_s"] = percentile(per_search, 0.5)
        out["rollout/search_latency_p99_s"] = percentile(per_search, 0.99)
    versions = {v for s in samples for v in s.weight_versions}
    if len(versions) > 1:
        raise RuntimeError(f"a rollout mixed weight versions {sorted(versions)}; engines were updated mid-rollout")
    if versions and next(iter(versions)).isdigit():  # a scripted engine (no weights) may name its version
        out["rollout/weight_version"] = float(versions.pop())
    return out


def check_engines_served(samples: list[Sample]) -> None:
    """An engine fault costs the trajectories it hit; when it hit every one, no engine is left and the step fails."""
    lost = [s for s in samples if s.metadata.get("finish_reason") == "engine_error"]
    if samples and len(lost) == len(samples):
        raise RuntimeError(f"no engine answered: all {len(samples)} trajectories failed ({lost[0].metadata['error']})")


def run_rollout(plugins: Plugins, args, source, config: RolloutConfig, params: dict, on_sample=None):
    """One rollout in its own event loop; the generate plugin's end-of-rollout hook runs before the loop ends."""
    from slime_search.rollout.rollout import generate_rollout

    async def run():
        try:
            return await generate_rollout(
                args, source, config, plugins.generate, plugins.reward, params, on_sample=on_sample
            )
        finally:
            await plugins.end_rollout()

    return asyncio.run(run())


def evaluation_samples(
    eval_sets: tuple[tuple[str, str], ...], data: DataConfig, reward_key: str, run: Callable, params: dict
) -> list[Sample]:
    """Every row of every eval set once, in file order; the set's NAME fills in a missing data_source."""
    samples = []
    for name, path in eval_sets:
        source = DataSource(replace(data, path=path, shuffle=False))
        config = RolloutConfig(batch_size=len(source), n_samples_per_prompt=1, reward_key=reward_key)
        groups, _ = run(source, config, params)
        for group in groups:
            for sample in group:
                sample.metadata["data_source"] = sample.metadata.get("data_source") or name
                samples.append(sample)
    return samples


class RolloutManager:
    def __init__(self, config: RolloutManagerConfig, plugin_args, gpu_ids: list[str] | None = None):
        from slime_search.engines.deployment import start_engines

        self.config = config
        self.engines = start_engines(config.engines, Path(config.log_dir), gpu_ids)
        self.plugin_args = plugin_args_for(plugin_args, self.engines)
        self.plugins = Plugins.load(config.generate_path, config.reward_path)
        self.source = DataSource(config.data)
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
    def _run(self, source, config: RolloutConfig, params: dict):
        return run_rollout(self.plugins, self.plugin_args, source, config, params, self._count)

    def generate(self, examples: int = 0) -> tuple[list[TrainSample], dict[str, float], list[dict]]:
        """One training rollout: train samples with GRPO advantages, metrics, and `examples` rendered samples."""
        from slime_search.rollout.rollout import assign_advantages

        config = self.config.rollout
        groups, metrics = self._run(self.source, config, self.config.sampling_params)
        everything = [s for g in groups for s in g]
        check_engines_served(everything)
        metrics.update(rollout_metrics(everything))
        samples = assign_advantages(everything, config.reward_key, config.normalize_advantages_std)
        shown = [sample_record(s, config.reward_key) for s in everything[:examples]]
        return [TrainSample.from_sample(s) for s in samples], metrics, shown

    def evaluate(self, examples: int = 0) -> tuple[dict[str, float], list[dict]]:
        """Greedy decoding of every eval set; the reward's numeric keys (EM, F1, ...) per data source, search rate,
        turns."""
        from slime_search.rollout.evaluation import evaluate_samples

        reward_key = self.config.rollout.reward_key
        samples = evaluation_samples(
            self.config.eval_sets, self.config.data, reward_key, self._run, self.config.eval_sampling_params
        )
        shown = [sample_record(s, reward_key) for s in samples[:examples]]
        return evaluate_samples(samples, reward_key), shown

    # ---- engines and state -------------------------------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine gives back the memory of `tags` to a colocated trainer (all of it by default)."""
        self._on_every_engine("release_memory", tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._on_every_engine("resume_memory", tags)

    def _on_every_engine(self, method: str, *args) -> None:
        # Module-level coroutines, not async methods: an async method would turn the RolloutManager into an async
        # Ray actor, whose synchronous methods could not run their own event loops.
        from slime_search.engines.client import call_engine, on_every_engine

        asyncio.run(on_every_engine(self.engines.worker_urls, lambda url: call_engine(url, method, *args)))

    def restart_down_engines(self) -> list[str]:
        """Start again every engine that has died or stopped answering (not waited for); returns their addresses."""
        down = self.engines.find_down()
        self.engines.restart(down)
        return down

    def wait_restarted_engines(self) -> list[str]:
        """Wait until the restarted engines are ready; returns their addresses (they need the current weights)."""
        return self.engines.wait_restarted()

    def worker_urls(self) -> list[str]:
        """Every engine's own address (not the router's), for weight updates."""
        return list(self.engines.worker_urls)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["data"])

    def shutdown(self) -> None:
        self.engines.stop()
