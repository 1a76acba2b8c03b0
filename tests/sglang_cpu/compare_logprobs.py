"""How far apart the CPU engine's and real SGLang's log-probs are, on the same checkpoint and the same tokens.

    python -m tests.sglang_cpu.compare_logprobs                 # the tiny Qwen2, 16 prompts x 32 greedy tokens

Both engines decode greedily (the same argmax path, so the same tokens) and report log softmax of the logits at each
token; an HF float32 forward over prompt + output is the reference. Prints the largest and mean absolute
differences: CPU engine vs SGLang, and each vs HF. Needs `bash tests/sglang_cpu/setup.sh`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx
import torch


def served(url: str, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens},
        "return_logprob": True,
    }
    meta = httpx.post(f"{url}/generate", json=body, timeout=600).json()["meta_info"]
    return [token for _, token, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


def differences(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b, strict=True)]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from slime_search.models.tiny_qwen import save_tiny_checkpoint
    from slime_search.utils.net import free_port
    from slime_search.utils.server_process import ServerProcess
    from tests import sglang_cpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    checkpoint = save_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [
        torch.randint(1000, 100000, (8 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(args.prompts)
    ]
    cpu_argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint), "--port", "0"]
    with ServerProcess(cpu_argv) as cpu, sglang_cpu.start_engine(checkpoint, free_port()) as sglang:
        gaps = {"cpu engine vs sglang": [], "cpu engine vs hf": [], "sglang vs hf": []}
        for prompt in prompts:
            cpu_ids, cpu_lps = served(cpu.url, prompt, args.tokens)
            sglang_ids, sglang_lps = served(sglang.url, prompt, args.tokens)
            if cpu_ids != sglang_ids:
                raise SystemExit(f"the greedy paths differ for prompt {prompt[:4]}...: {cpu_ids} vs {sglang_ids}")
            with torch.no_grad():
                logits = model(torch.tensor([prompt + cpu_ids])).logits[0]
            log_probs = torch.log_softmax(logits, -1)
            hf = [log_probs[len(prompt) - 1 + i, t].item() for i, t in enumerate(cpu_ids)]
            gaps["cpu engine vs sglang"] += differences(cpu_lps, sglang_lps)
            gaps["cpu engine vs hf"] += differences(cpu_lps, hf)
            gaps["sglang vs hf"] += differences(sglang_lps, hf)
    report = {name: {"max": max(g), "mean": sum(g) / len(g), "tokens": len(g)} for name, g in gaps.items()}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
