"""The engine probe's gaps (slime_search.run.engine_check), measured: the float noise its bound must clear and the
wrong engines it must catch, as the mean |engine - trainer| log-prob per token of teacher-forced tokens.

    python -m benchmarks.perf.engine_probe --work /tmp/probe [--trainer [--engine-url URL]] \
        [--policy HF_DIR --sample RUN/rollouts.jsonl]

It always measures bfloat16 against float32 (an HF forward on this machine). It does so on the tiny random Qwen2 policy
(made in --work, or --tiny) over a chat prompt and a response. With --policy it also does so on that policy's own
sample: the last training sample of a run's rollouts.jsonl, prompt and response, at most 512 tokens. With --trainer it
measures the Megatron actor at TP 2 under Ray, float32 (RayTrainGroup.trainer_log_probs). The actor is set against a CPU
engine server on the same weights and against one on another random policy. It is also set against --engine-url, an
engine serving the tiny policy of --work (real SGLang, for one). Each engine is read through the probe's own call
(EngineClient.input_log_probs). Prints one JSON object.

Its figures: `docs/benchmarks/health.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

PROMPT = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198]  # a chat turn of the Qwen2 template
RESPONSE = [40, 1079, 264, 10950, 17847, 13, 151645]
PROBE_TOKENS = 512


def forced_log_probs(checkpoint, tokens: list[int], dtype) -> list[float]:
    """An HF forward's log-probs of tokens[1:], each given those before it, at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    return [log_probs[i - 1, token].item() for i, token in enumerate(tokens) if i]


def mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def bfloat16_gap(checkpoint, tokens: list[int]) -> float:
    import torch

    return mean_gap(
        forced_log_probs(checkpoint, tokens, torch.bfloat16), forced_log_probs(checkpoint, tokens, torch.float32)
    )


def policy_sample(policy: Path, rollouts: Path) -> list[int]:
    """The last training sample of a run's rollouts.jsonl, prompt and response, in the policy's tokens."""
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in rollouts.read_text().splitlines() if line.strip()]
    last = [row for row in rows if row["kind"] == "train"][-1]
    text = last["prompt"] + "".join(text for text, _ in last["segments"])
    return AutoTokenizer.from_pretrained(policy)(text, add_special_tokens=False)["input_ids"][:PROBE_TOKENS]


def trainer_gaps(tiny: Path, other: Path, engine_url: str | None, tokens: list[int]) -> dict[str, float]:
    """The Megatron actor (TP 2, float32, CPU) against CPU engine servers on its weights and on other ones, and
    against `engine_url`."""
    import ray

    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.engines.client import call_engine, on_every_engine
    from slime_search.ray.train_group import ModelSource, RayTrainGroup, TrainGroupConfig
    from slime_search.run.engine_check import probe_gaps
    from slime_search.utils.server_process import ServerProcess

    def engine(checkpoint) -> ServerProcess:
        argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint), "--port", "0"]
        return ServerProcess(argv, health_path="/health_generate")

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    group = RayTrainGroup(TrainGroupConfig(num_ranks=2, tp_size=2))
    try:
        group.load_models(ModelSource(str(tiny)), ActorConfig(loss=LossConfig(vocab_size=151936, temperature=0.7)))
        trainer = group.trainer_log_probs(tokens)
        with engine(tiny) as same, engine(other) as wrong:
            names = {same.url: "cpu_engine_same_weights", wrong.url: "cpu_engine_other_weights"}
            if engine_url:
                names[engine_url] = "engine_url"
            answers = asyncio.run(on_every_engine(list(names), lambda url: call_engine(url, "input_log_probs", tokens)))
        gaps = probe_gaps(dict(zip(names, answers, strict=True)), trainer)
        return {f"megatron_tp2_vs_{names[url]}": gap for url, gap in gaps.items()}
    finally:
        group.shutdown()
        if started:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the tiny policies")
    parser.add_argument("--tiny", type=Path, help="the tiny random policy (default: made in --work)")
    parser.add_argument("--trainer", action="store_true", help="also the Megatron actor against engines")
    parser.add_argument("--engine-url", help="with --trainer: an engine serving --work's tiny policy (e.g. SGLang)")
    parser.add_argument("--policy", type=Path, help="a trained HF policy folder (e.g. RUN/weights/step_20)")
    parser.add_argument("--sample", type=Path, help="with --policy: the run's rollouts.jsonl")
    args = parser.parse_args(argv)
    if (args.policy is None) != (args.sample is None):
        parser.error("--policy and --sample go together: the policy's own sample is read from its run's rollouts")
    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint

    args.work.mkdir(parents=True, exist_ok=True)
    tiny = args.tiny or args.work / "tiny"
    if not (tiny / "config.json").is_file():
        save_tiny_checkpoint(tiny)
    tokens = PROMPT + RESPONSE
    out: dict[str, float] = {"tokens": float(len(tokens)), "bf16_vs_fp32_tiny_random": bfloat16_gap(tiny, tokens)}
    if args.policy is not None:
        sample = policy_sample(args.policy, args.sample)
        out.update(policy_tokens=float(len(sample)), bf16_vs_fp32_policy=bfloat16_gap(args.policy, sample))
    if args.trainer:
        other = args.work / "other"
        if not (other / "config.json").is_file():
            save_tiny_checkpoint(other, TinyQwenConfig(seed=1))
        out.update(trainer_gaps(tiny, other, args.engine_url, tokens))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
