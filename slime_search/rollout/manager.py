"""The rollout side of training, run as one Ray actor: engines, prompt data, generate/reward plugins, eval.

The manager starts the inference engines it needs (slime_search.engines.deployment), so they live and die with it.
It takes its typed configuration, built once by the driver, and the parsed flags, which it hands to the plugins
(slime's plugin contract) together with the address of its engines. A rollout runs on a worker thread of the actor
while the driver polls `progress()` from another thread to draw its progress bar. For asynchronous training the
manager runs a stream of groups on a thread of its own instead (slime_search.rollout.stream) and hands the trainer a
batch at a time; around each weight push it drains the stream (one-step) or pauses the engines, which then continue
every running generation under the new weights (fully).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slime_search.config.rollout import RolloutManagerConfig
from slime_search.evaluation.subsets import ROW_KEY, SET_SIZE_KEY, EvalSubset, UngradedQuestions
from slime_search.plugins import Plugins
from slime_search.rollout.data_source import DataConfig, DataSource, count_rows, load_rows
from slime_search.rollout.rollout import RolloutConfig
from slime_search.rollout.sample_metrics import mask_stale_tokens, rollout_metrics, sample_record, staleness_metrics
from slime_search.rollout.stream import ActivityClock, RolloutStream, StreamConfig
from slime_search.types import Sample, TrainSample
from slime_search.utils.actor_logging import log_to_run_folder


@dataclass
class RolloutBatch:
    """What one step trains on and what it says about how it was made."""

    samples: list[TrainSample]  # the trainable samples, with GRPO advantages
    metrics: dict[str, float]
    examples: list[dict]  # rendered samples for the report
    errors: dict[str, str] = field(default_factory=dict)  # failure cause -> its first message (finish_reason: text)


def plugin_args_for(args: Any, engines, served_adapter: str | None = None) -> argparse.Namespace:
    """What the plugins receive as `args`, in a new namespace.

    The namespace holds the parsed flags, which themselves are never changed. It adds one address for /generate,
    `engine_url`: the router in front of several engines, or the one engine. That address is also given as slime's
    `sglang_router_ip` and `sglang_router_port`, which slime's plugins read. `engine_urls` holds every engine's own
    address, for a plugin that spreads its trajectories over them. `lora_path` (SGLang's /generate field) names the
    adapter the engines serve the policy as, and every /generate must name it. It is None when the engines serve
    the policy as plain weights.
    """
    from urllib.parse import urlsplit

    address = urlsplit(engines.url)
    return argparse.Namespace(
        **{
            **vars(args),
            "engine_url": engines.url,
            "engine_urls": list(engines.worker_urls),
            "sglang_router_ip": address.hostname,
            "sglang_router_port": address.port,
            "lora_path": served_adapter,
        }
    )


def counted(generate, clock: ActivityClock):
    """The generate plugin, with the trajectories it is generating counted by `clock`."""

    async def generate_counted(args, sample, params):
        clock.started()
        try:
            return await generate(args, sample, params)
        finally:
            clock.finished()

    return generate_counted


def run_rollout(plugins: Plugins, args, source, config: RolloutConfig, params: dict, on_sample=None, clock=None):
    """One rollout in its own event loop; the generate plugin's end-of-rollout hook runs before the loop ends."""
    from slime_search.rollout.rollout import generate_rollout

    generate = plugins.generate if clock is None else counted(plugins.generate, clock)

    async def run():
        try:
            return await generate_rollout(args, source, config, generate, plugins.reward, params, on_sample=on_sample)
        finally:
            await plugins.end_rollout()

    return asyncio.run(run())


def evaluation_samples(
    eval_sets: tuple[tuple[str, str], ...],
    data: DataConfig,
    reward_key: str,
    run: Callable,
    params: dict,
    subset: EvalSubset | UngradedQuestions | None = None,
) -> list[Sample]:
    """The subset's rows of every eval set (all by default) once, in file order; the set's NAME fills in a missing
    data_source. Each sample's metadata holds its row in the file (ROW_KEY), which names the question when
    comparing runs: a prompt is not a question's identity, two questions may share one. A set the subset leaves
    nothing of (the questions left out of a set graded whole) is passed over."""
    samples = []
    for name, path in eval_sets:
        rows = load_rows(path)
        indices = (subset or EvalSubset()).indices(name, len(rows))
        if rows and not indices:
            continue
        chosen = [
            {**rows[i], data.metadata_key: {**(rows[i].get(data.metadata_key) or {}), ROW_KEY: i}} for i in indices
        ]
        source = DataSource(replace(data, path=path, shuffle=False), rows=chosen)
        config = RolloutConfig(batch_size=len(source), n_samples_per_prompt=1, reward_key=reward_key)
        groups, _ = run(source, config, params)
        for group in groups:
            for sample in group:
                sample.metadata["data_source"] = sample.metadata.get("data_source") or name
                if len(chosen) < len(rows):  # a subset: its interval is about the whole set's score
                    sample.metadata[SET_SIZE_KEY] = len(rows)
                samples.append(sample)
    return samples


def evaluation_sizes(
    eval_sets: tuple[tuple[str, str], ...], subset: EvalSubset | UngradedQuestions | None = None
) -> dict[str, int]:
    """How many questions of each eval set `evaluation_samples` grades with `subset` (every one by default)."""
    return {name: len((subset or EvalSubset()).indices(name, count_rows(path))) for name, path in eval_sets}


def train_batch(groups: list[list[Sample]], config: RolloutConfig, metrics: dict[str, float], examples: int):
    """GRPO advantages and the trainer's samples of a batch of groups, with its metrics, `examples` rendered samples
    and the first error of each kind of failure."""
    from slime_search.rollout.rollout import assign_advantages, first_errors

    everything = [s for g in groups for s in g]
    samples = assign_advantages(everything, config.reward_key, config.normalize_advantages_std)
    shown = [sample_record(s, config.reward_key) for s in everything[:examples]]
    return RolloutBatch([TrainSample.from_sample(s) for s in samples], metrics, shown, first_errors(everything))


def idle_metric(clock: ActivityClock) -> dict[str, float]:
    idle, elapsed = clock.read()
    return {"async/engine_idle_fraction": idle / elapsed if elapsed > 0 else 0.0}


class RolloutManager:
    def __init__(self, config: RolloutManagerConfig, plugin_args, gpu_ids: list[str] | None = None):
        from slime_search.engines.deployment import start_engines

        log_to_run_folder(config.log_dir, "rollout_manager")  # first, so that the engines' start is in it too
        self.config = config
        self.sampling_params = dict(config.sampling_params)  # of the current attempt (set_sampling_attempt)
        self.engines = start_engines(config.engines, Path(config.log_dir), gpu_ids)
        self.plugin_args = plugin_args_for(plugin_args, self.engines, config.served_adapter)
        self.plugins = Plugins.load(config.generate_path, config.reward_path)
        self.source = DataSource(config.data)
        self.clock = ActivityClock()  # when no trajectory is being generated: the engines are idle
        self.stream: RolloutStream | None = None
        self._lock = threading.Lock()
        self._progress = (0, 0)

    # ---- progress (answered from a second thread of the actor while a rollout runs) ----------------------
    def progress(self) -> tuple[int, int]:
        if self.stream is not None:
            return self.stream.progress()
        with self._lock:
            return self._progress

    def _count(self, done: int, total: int) -> None:
        with self._lock:
            self._progress = (done, total)

    # ---- rollouts ---------------------------------------------------------------------------------------------
    def _run(self, source, config: RolloutConfig, params: dict, clock: ActivityClock | None = None):
        return run_rollout(self.plugins, self.plugin_args, source, config, params, self._count, clock)

    def generate(self, examples: int = 0) -> RolloutBatch:
        """One training rollout: train samples with GRPO advantages, metrics, and `examples` rendered samples."""
        config = self.config.rollout
        groups, metrics = self._run(self.source, config, self.sampling_params, self.clock)
        everything = [s for g in groups for s in g]
        metrics.update(rollout_metrics(everything))
        metrics.update(idle_metric(self.clock))
        return train_batch(groups, config, metrics, examples)

    # ---- asynchronous training: a stream of groups ---------------------------------------------------------------
    def start_stream(self, max_staleness: int, policy_version: int, batch_order: str = "completion") -> None:
        """Generate groups continuously from now on, `max_staleness` versions ahead of the trainer at most."""
        self.stream = RolloutStream(
            self.plugins,
            self.plugin_args,
            self.source,
            StreamConfig(self.config.rollout, max_staleness, batch_order),
            self.sampling_params,
            policy_version,
            self.clock,
        )
        self.stream.start()

    def next_batch(self, trainer_version: int, examples: int = 0, max_token_lag: int | None = None):
        """The next batch of complete groups, as `generate` answers, with how stale it is for the policy at
        `trainer_version` (the version the actor trains it with); tokens more than `max_token_lag` versions old
        leave the loss."""
        from slime_search.rollout.rollout import batch_metrics

        config = self.config.rollout
        groups = self.stream.take_batch()
        everything = [s for g in groups for s in g]
        metrics = batch_metrics(groups, 0, config.reward_key)
        metrics.update(rollout_metrics(everything, single_version=False))
        metrics.update(staleness_metrics(everything, trainer_version))
        metrics.update(self.stream.counts())
        metrics.update(idle_metric(self.clock))
        batch = train_batch(groups, config, metrics, examples)
        if max_token_lag is not None:
            masked = mask_stale_tokens(batch.samples, trainer_version, max_token_lag)
            batch.metrics["async/tokens_masked_stale"] = float(masked)
        return batch

    def stop_stream(self) -> None:
        """No more batches are needed: what is in flight is cancelled (the final evaluation runs alone)."""
        if self.stream is not None:
            self.stream.stop()
            self.stream = None

    def drain(self) -> None:
        """Wait until no group is being generated (one-step: before a push, so no trajectory spans two versions)."""
        self.stream.drain()

    def pause_generation(self, urls: list[str] | None = None) -> None:
        """Before a push: every engine (or those of `urls`) stops its running generations where they are; they
        continue after it. New requests wait meanwhile."""
        self._on_every_engine("pause_generation", "retract", urls=urls)

    def continue_generation(self, urls: list[str] | None = None) -> None:
        self._on_every_engine("continue_generation", urls=urls)

    def set_policy_version(self, version: int) -> None:
        """The engines serve `version` now: the stream may admit the groups it allows."""
        self.stream.set_policy_version(version)

    def evaluate(self, examples: int = 0, subset=None) -> tuple[dict[str, float], list[dict]]:
        """Greedy decoding of every eval set (the questions of `subset`, by default those of --eval-sample); the
        reward's numeric keys (EM, F1, ...) per data source, search rate, turns, and the per-question grades (GRADES).
        """
        from slime_search.rollout.eval_metrics import GRADES, evaluate_samples, question_grades

        reward_key = self.config.rollout.reward_key
        config = self.config
        samples = evaluation_samples(
            config.eval_sets, config.data, reward_key, self._run, config.eval_sampling_params,
            subset or config.eval_subset,
        )  # fmt: skip
        shown = [sample_record(s, reward_key) for s in samples[:examples]]
        return {**evaluate_samples(samples, reward_key), GRADES: question_grades(samples, reward_key)}, shown

    def evaluate_weights(self, model_path: str, version: int, examples: int = 0) -> dict[str, Any]:
        """--eval-engine: the engines load the HF folder of `version`, then the evaluation above runs on them. The
        version each engine serves afterwards is checked: a result is never attributed to weights it did not
        evaluate."""
        import time

        from slime_search.engines.client import call_engine, check_success, on_every_engine

        async def load(url: str) -> str:
            answer = await call_engine(url, "update_weights_from_disk", model_path, str(version))
            check_success(url, "update_weights_from_disk", answer)
            return await call_engine(url, "weight_version")

        started = time.perf_counter()
        served = asyncio.run(on_every_engine(self.engines.worker_urls, load))
        if any(str(v) != str(version) for v in served):
            raise RuntimeError(f"the eval engine serves version(s) {served} after loading version {version}")
        loaded = time.perf_counter()
        metrics, shown = self.evaluate(examples)
        return {
            "version": version,
            "metrics": metrics,
            "shown": shown,
            "load_s": loaded - started,
            "eval_s": time.perf_counter() - loaded,
        }

    # ---- engines and state -------------------------------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine gives back the memory of `tags` to a colocated trainer (all of it by default).

        Each engine does so once it is idle. SGLang's whole process exits on a release while a request is running or
        waiting.
        """
        from slime_search.engines.client import on_every_engine, release_memory_when_idle

        asyncio.run(on_every_engine(self.engines.worker_urls, lambda url: release_memory_when_idle(url, tags)))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._on_every_engine("resume_memory", tags)

    def _on_every_engine(self, method: str, *args, urls: list[str] | None = None) -> None:
        # Module-level coroutines, not async methods: an async method would turn the RolloutManager into an async
        # Ray actor, whose synchronous methods could not run their own event loops.
        from slime_search.engines.client import call_engine, on_every_engine

        targets = self.engines.worker_urls if urls is None else urls
        asyncio.run(on_every_engine(targets, lambda url: call_engine(url, method, *args)))

    def restart_down_engines(self) -> list[str]:
        """Start again every engine that has died or stopped answering (not waited for); returns their addresses."""
        down = self.engines.find_down()
        self.engines.restart(down)
        return down

    def restart_engine(self, url: str) -> None:
        """Stop the engine at `url` and start it again on its address (not waited for: `wait_restarted_engines`), as
        a dead one is; it serves the checkpoint it was started from until it is pushed the current weights. Raises
        ValueError for an engine this run did not start."""
        self.engines.restart([url])

    def engine_log_probs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Every engine's log-probs of token_ids[1:], each given the tokens before it (teacher-forced, temperature
        1: EngineClient.input_log_probs), by engine address: the engines' half of the probe against the trainer."""
        from slime_search.engines.client import call_engine, on_every_engine

        urls = list(self.engines.worker_urls)
        adapter = self.config.served_adapter
        answers = asyncio.run(
            on_every_engine(urls, lambda url: call_engine(url, "input_log_probs", token_ids, lora_path=adapter))
        )
        return dict(zip(urls, answers, strict=True))

    def wait_restarted_engines(self) -> list[str]:
        """Wait until the restarted engines are ready; returns their addresses (they need the current weights)."""
        return self.engines.wait_restarted()

    def worker_urls(self) -> list[str]:
        """Every engine's own address (not the router's), for weight updates."""
        return list(self.engines.worker_urls)

    def state_dict(self) -> dict[str, Any]:
        """The data position; with a stream running, the prompts it took and the trainer has not trained on are
        given back (a resumed run generates them again)."""
        return {"data": self.stream.data_state() if self.stream is not None else self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["data"])

    def set_sampling_attempt(self, attempt: int) -> None:
        """Training rollouts from now on sample as the run's `attempt`-th timeline does (rollout.attempt_params): the
        recovery sets it after each rollback and on a resume. A stream already running keeps its parameters: it is
        restarted after a rollback."""
        from slime_search.rollout.rollout import attempt_params

        self.sampling_params = attempt_params(self.config.sampling_params, attempt)

    def shutdown(self) -> None:
        self.stop_stream()
        self.engines.stop()
