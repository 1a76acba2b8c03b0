"""Step throughput of --async-mode off / one-step / fully at GPU scale, emulated on this machine.

    python -m benchmarks.perf.rollout_overlap --engines 1 --actor-gpus 7 --prompts 64 --samples 5 --steps 8

The real driver loop (slime_search.run.loop.run_steps), RolloutManager (a Ray actor) and Search-R1 generate plugin run
against a real retriever: BM25 over ../shared/data/corpus/wiki18_subset.jsonl. The engines are emulated SGLang engines,
one per H100 (benchmarks.harness.stand_in_engines.emulated). They answer real Search-R1 3B turns from
../shared/data/trajectories, paced by a continuous-batching model of Qwen2.5-3B on an H100. Two stand-ins replace what
needs GPUs, each named here:
* the actor: a step takes the documented Megatron time of a 3B GRPO step (`ActorTiming`). That is 48 s policy update +
  39 s forward for 2,560 samples on 8 H100 (SkyRL docs/content/docs/examples/megatron.mdx, Qwen2.5-3B-Instruct
  SearchR1). It is scaled linearly in samples and inversely in GPUs;
* the weight push: every engine takes the modelled NCCL push time, then serves the new version.
Every emulated duration runs `--time-scale` times real time, so that the sweep fits in minutes; the rates printed
are in emulated seconds. Prints a markdown table per mode (docs/benchmarks/async.md records it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.paths import SHARED

TRAJECTORIES = ("nq", "triviaqa", "popqa", "bamboogle")


@dataclass(frozen=True)
class ActorTiming:
    seconds_per_sample_gpu: float = (48.0 + 39.0) * 8 / 2560  # GPU-seconds per sample (SkyRL, 3B, Megatron)
    gpus: int = 7
    time_scale: float = 1.0

    def step_s(self, samples: int) -> float:
        return self.seconds_per_sample_gpu * samples / self.gpus


@dataclass(frozen=True)
class TimedGroupConfig:
    use_gpu: bool = False  # the placement helpers ask; the emulated engines are not Ray's to place


class TimedTrainGroup:
    """The actor, for this benchmark only: `optimize` takes the modelled step time (`prepare`, the old log-probs, is
    part of it: the old policy's log-probs are the engine's here); checkpoints are not measured."""

    def __init__(self, timing: ActorTiming):
        self.timing = timing
        self.config = TimedGroupConfig()

    def prepare(self, samples) -> None:
        for sample in samples:
            sample.old_log_probs = sample.rollout_log_probs

    def optimize(self, samples, steps: int, skip_above: float | None = None) -> dict[str, float]:
        seconds = self.timing.step_s(len(samples))
        time.sleep(seconds * self.timing.time_scale)
        return {"train/loss": 0.0, "train/emulated_step_s": seconds, "train/steps": 1.0, "train/steps_applied": 1.0}

    def set_lr_scale(self, scale: float) -> None:
        """No learning rate to scale."""

    def save(self, *args) -> None:
        """Checkpoints are not part of the measurement."""

    def shutdown(self) -> None:
        pass


class EmulatedPush:
    """The weight push, for this benchmark only: every engine takes the modelled push time, then serves `version`."""

    def __init__(self, urls: list[str]):
        self.urls = urls

    def push(self, version: str) -> str:
        from slime_search.engines.client import call_engine, on_every_engine
        from slime_search.weight_sync.transport_base import check_served, served_versions

        async def push_all():
            await on_every_engine(self.urls, lambda url: call_engine(url, "update_weights_from_disk", "-", version))
            return await served_versions(self.urls)

        return check_served(asyncio.run(push_all()), version)

    def reconnect(self) -> None:
        pass


def write_prompts(out: Path, limit: int) -> Path:
    from slime_search.search_r1.prompt import make_row

    rows = []
    for name in TRAJECTORIES:
        path = SHARED / "trajectories" / f"search_r1_3b_base_{name}.jsonl"
        for i, line in enumerate(path.read_text().splitlines()):
            row = json.loads(line)
            example = {"question": row["question"], "golden_answers": row["golden_answers"]}
            rows.append(make_row(example, name, "train", i))
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:limit]))
    return path


def engine_state(urls: list[str]) -> list[dict]:
    import httpx

    return [httpx.get(f"{url}/server_info", timeout=30).json()["internal_states"][0] for url in urls]


def run_mode(mode: str, args, engine_urls: list[str], retriever_url: str, prompts: Path, work: Path) -> dict:

    from slime_search.arguments import parse_args
    from slime_search.health.guard import HealthGuard
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.ray.placement import create_rollout_manager, stop_rollout_manager
    from slime_search.rollout.schedule import create_schedule
    from slime_search.run.config import run_config
    from slime_search.run.evaluators import InStepEval
    from slime_search.run.folder import RunFolder
    from slime_search.run.loop import run_steps
    from slime_search.run.parts import RunParts
    from slime_search.run.recovery import Recovery

    run_dir = work / f"run-{mode}"
    flags = [
        "--hf-checkpoint", str(args.tokenizer), "--save", str(run_dir), "--prompt-data", str(prompts),
        "--apply-chat-template", "--rollout-shuffle", "--num-rollout", str(args.steps),
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", "500", "--max-turns", "4", "--max-obs-tokens", "500",
        "--rollout-concurrency", str(args.concurrency), "--generation-concurrency", str(args.concurrency),
        "--search-concurrency", str(args.concurrency), "--search-url", f"{retriever_url}/retrieve",
        "--engine-url", ",".join(engine_urls), "--async-mode", mode, "--max-staleness", str(args.max_staleness),
        "--engine-health-timeout", "600", "--log-rollout-examples", "0",
    ]  # fmt: skip
    parsed = parse_args(flags)
    config = run_config(parsed, vocab_size=151936, use_gpu=False)
    timing = ActorTiming(args.actor_gpu_seconds_per_sample, args.actor_gpus, args.time_scale)
    group = TimedTrainGroup(timing)
    run = RunFolder(run_dir)
    sink = MetricsSink(run.path, False, "bench", None, config={})
    manager = create_rollout_manager(config.rollout, parsed, group, colocate=False)
    parts = RunParts(
        config, run, sink, group, HealthGuard(config.health), manager, EmulatedPush(engine_urls),
        Colocation(False, group, manager), InStepEval(config, manager), create_schedule(config.schedule, manager),
    )  # fmt: skip
    try:
        parts.transport.push("0")
        before, started = engine_state(engine_urls), time.monotonic()
        run_steps(parts, Recovery(parts), 0)
        wall, after = time.monotonic() - started, engine_state(engine_urls)
    finally:
        stop_rollout_manager(manager)
        sink.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize(mode, records, wall / args.time_scale, before, after, args)


def summarize(mode: str, records: list[dict], emulated_s: float, before, after, args) -> dict:
    steady = records[1:] or records  # the first step fills the pipeline

    def per_engine(key: str) -> float:  # an engine's emulated seconds over the run, the mean over the engines
        return sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) / len(after)

    lag_keys = sorted({k for r in steady for k in r if k.startswith("async/staleness_tokens_lag_")})
    return {
        "mode": mode,
        "steps": len(records),
        "emulated_s": emulated_s,
        "step_s_steady": sum(r["time/step_s"] for r in steady) / len(steady) / args.time_scale,
        "trajectories_per_s": len(records) * args.prompts * args.samples / emulated_s,
        "engine_busy_fraction": per_engine("busy_s") / emulated_s,
        # where it was not: nothing to decode (after a weight update, waiting for the next batch; or within a batch)
        "engine_idle_s": round(per_engine("idle_s"), 2),
        "engine_idle_after_update_s": round(per_engine("idle_after_update_s"), 2),
        "engine_idle_gaps": round(per_engine("idle_gaps"), 1),
        "engine_paused_s": round(per_engine("paused_s"), 2),
        # the emulation's own cost: decode steps behind the GPU model while the emulator's event loop was busy
        "engine_late_s": round(per_engine("late_s"), 2),
        # the largest lag behind the GPU model an engine's clock made up (its one event loop busy with a burst)
        "engine_max_lag_s": round(max(a["max_lag_s"] for a in after), 3),
        "trainer_idle_fraction": sum(r["async/trainer_idle_fraction"] for r in steady) / len(steady),
        "interrupted_per_step": sum(r.get("async/interrupted_trajectories", 0.0) for r in steady) / len(steady),
        "token_lag": {
            k.rsplit("_", 1)[1]: round(sum(r.get(k, 0.0) for r in steady) / len(steady), 3) for k in lag_keys
        },
    }


def busy_where_it_could_work(result: dict) -> float:
    """The engine's busy share of the time it was not running late: the emulator's own event loop, holding decode
    steps back, is a CPU standing in for a GPU, not the driver keeping the engine waiting."""
    emulated = result["emulated_s"]
    return result["engine_busy_fraction"] * emulated / max(emulated - result["engine_late_s"], 1e-9)


def table(results: list[dict]) -> str:
    base = next(r for r in results if r["mode"] == "off")
    lines = [
        "| mode | steady step (s) | trajectories/s | speed-up vs off | engine busy | engine busy without its late steps |"
        " trainer idle | interrupted/step | token lag (share of tokens) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lag = ", ".join(f"{k}: {v:.2f}" for k, v in r["token_lag"].items())
        lines.append(
            f"| {r['mode']} | {r['step_s_steady']:.1f} | {r['trajectories_per_s']:.1f} | "
            f"{base['step_s_steady'] / r['step_s_steady']:.2f}x | {r['engine_busy_fraction']:.2f} | "
            f"{busy_where_it_could_work(r):.2f} | {r['trainer_idle_fraction']:.2f} | {r['interrupted_per_step']:.1f} | {lag} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1, help="emulated SGLang engines, one H100 each")
    parser.add_argument("--actor-gpus", type=int, default=7, help="H100s of the emulated actor")
    parser.add_argument(
        "--actor-gpu-seconds-per-sample",
        type=float,
        default=ActorTiming.seconds_per_sample_gpu,
        help="the actor's cost per sample (default: SkyRL's documented 3B Megatron step); other values for a sweep",
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1024, help="trajectories in flight, at most")
    parser.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per emulated second")
    parser.add_argument("--modes", nargs="+", default=["off", "one-step", "fully"])
    parser.add_argument("--tokenizer", help="HF folder with the Qwen2 tokenizer (default: a tiny Qwen2 built here)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not (SHARED / "trajectories").is_dir():
        print(f"needs the Search-R1 trajectories and corpus under {SHARED}", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    try:
        results = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the tokenizer, the index, the runs' folders: the figures are printed
    if any(r["mode"] == "off" for r in results):
        print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


def measure(args, work: Path) -> list[dict]:
    """Every mode of args.modes, one after the other, beside one retriever; each mode with engines of its own."""
    import ray

    from local_dense_retriever import build_index
    from local_dense_retriever.launch import RetrievalServerProcess
    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.utils.server_process import ServerProcess

    args.tokenizer = args.tokenizer or str(save_tiny_checkpoint(work / "tiny"))
    corpus = SHARED / "corpus" / "wiki18_subset.jsonl"
    build_index.main(["--retriever-name", "bm25", "--corpus-path", str(corpus), "--save-dir", str(work)])
    prompts = write_prompts(work, limit=100_000)
    engine_argv = [
        "-m", "benchmarks.harness.stand_in_engines.emulated", "--tokenizer", args.tokenizer, "--port", "0",
        "--time-scale", str(args.time_scale),
        "--trajectories", *(str(SHARED / "trajectories" / f"search_r1_3b_base_{n}.jsonl") for n in TRAJECTORIES),
    ]  # fmt: skip
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    results = []
    retriever_args = ["--retriever-name", "bm25", "--index-path", str(work / "bm25"), "--corpus-path", str(corpus)]
    try:
        with RetrievalServerProcess(*retriever_args, "--topk", "3") as retriever:
            for mode in args.modes:
                engines = [ServerProcess(engine_argv, timeout=300) for _ in range(args.engines)]
                try:
                    results.append(run_mode(mode, args, [e.url for e in engines], retriever.url, prompts, work))
                finally:
                    for engine in engines:
                        engine.stop()
                print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    return results


if __name__ == "__main__":
    sys.exit(main())
