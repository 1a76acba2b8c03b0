"""One command that checks a bare GPU machine end to end and writes one JSON and one markdown table.

    bash scripts/gpu_kit_wheels.sh wheels/          # where a network is: the wheels the GPU machine lacks (< 64 MiB)
    pip install --no-deps wheels/*.whl              # on the GPU machine, in the checkout
    python -m benchmarks.gpu_kit --out gpu_kit/     # one CUDA GPU, 5.5 minutes on an H200
    python -m benchmarks.gpu_kit --cpu --out gpu_kit/   # the same steps, tiny model, CPU (2 min of CPU time)

Three parts, each in processes of its own (a fresh device each, a time limit each, and a part that fails is recorded
without stopping the others):
(a) checks: `benchmarks.megatron_gpu_checks`, the actor against Hugging Face on the device (logits, packed log-probs,
    GRPO steps, the colocated hand-over, the weight gather, the packed attention against the local one);
(b) step: `benchmarks.gpu_kit_step` once per attention implementation and budget (on CPU once per
    implementation), the packed attention against Megatron's local one on a Qwen2.5-3B-shaped model, at 2k, 4k and
    8k tokens per micro-batch (CPU: the tiny model at 64, 128, 256): step time, tokens/s, MFU, peak memory;
(c) loop: `benchmarks.gpu_kit_loop`, 3 GRPO steps colocated on the one device without Ray (0.5B-shaped on CUDA):
    weight_version, rollout/weight_version, train/train_rollout_logprob_abs_diff, time/sync_s per step.
Writes OUT/gpu_kit.json (every record of every part, with each part's return code, seconds and log tail) and
OUT/gpu_kit.md (the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def run_part(name: str, argv: list[str], timeout_s: float) -> dict:
    """Run `python -m argv...`; its stdout's JSON lines are its records. A timeout or a crash is recorded, not raised:
    the kit's point is to report what works and what does not."""
    started = time.perf_counter()
    # a session of its own: on a timeout the part's whole process group goes (the loop's engine server with it)
    process = subprocess.Popen(
        [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        returncode = "timeout"
        os.killpg(process.pid, signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
    records = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            # a log line that happens to start with a brace is not a record
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return {
        "part": name,
        "argv": ["python", "-m", *argv],
        "returncode": returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "records": records,
        "log_tail": stderr[-3000:] if returncode != 0 else "",
    }


CUDA_BUDGETS = "2048,4096,8192"


def plan(cpu: bool, budgets: str | None, skip: set[str]) -> list[tuple[str, list[str], float]]:
    """(part name, module argv, time limit in seconds) in the order they run: the correctness checks first, then the
    steps, then the loop. On CUDA each step budget runs in a process of its own: run one after another in one process,
    a budget inherited the allocator's layout of the one before (the local attention at 4,096 tokens ran out of memory
    after 2,048 on an H200, and fit at 135.7 GiB alone). The CUDA limits sum to under 10 minutes; on CPU each part may
    take 4 (a shared CI machine) and each attention's budgets share one process."""
    flag = ["--cpu"] if cpu else []
    parts = [("checks", ["benchmarks.megatron_gpu_checks", *(["--families", "qwen2"] if cpu else [])], 90)]
    for impl in ("packed", "local"):
        step = ["benchmarks.gpu_kit_step", "--attention-impl", impl, *flag]
        if cpu:
            parts.append((f"step_{impl}", step + (["--budgets", budgets] if budgets else []), 240))
            continue
        for budget in (budgets or CUDA_BUDGETS).split(","):
            parts.append((f"step_{impl}_{budget}", step + ["--budgets", budget], 60))
    parts.append(("loop", ["benchmarks.gpu_kit_loop", *flag], 130))
    parts = [(name, argv, 240 if cpu else limit) for name, argv, limit in parts if name.split("_")[0] not in skip]
    if "checks" in skip:  # the tables still name the device and the software they were measured on
        parts.insert(0, ("environment", ["benchmarks.megatron_gpu_checks", "--families", ""], 240 if cpu else 60))
    return parts


def _short_error(error: str) -> str:
    """The error's head for a table cell: an out-of-memory error keeps how much it asked for, with its unit."""
    asked = re.search(r"Tried to allocate [0-9.]+ [KMG]iB", error)
    if error.startswith("out of memory") and asked:
        return f"out of memory ({asked.group(0)[len('Tried to allocate ') :]} asked)"
    return error[:80]


def out_of_memory(part: dict) -> bool:
    return any(str(r.get("error", "")).startswith("out of memory") for r in part["records"])


def run_plan(planned: list[tuple[str, list[str], float]], runner=run_part) -> list[dict]:
    """Run the parts in order; an attention that ran out of memory at one budget is not tried at larger ones (they
    need more), and the skipped budgets are recorded as such."""
    parts, exhausted = [], set()
    for name, argv, limit in planned:
        impl = name.split("_")[1] if name.startswith("step_") else None
        if impl in exhausted:
            record = {"attention_impl": impl, "tokens_per_micro_batch": int(argv[-1]), "tokens_per_step": None}
            record["error"] = "not run: a smaller budget ran out of memory"
            parts.append(
                {
                    "part": name,
                    "argv": ["python", "-m", *argv],
                    "returncode": 0,
                    "seconds": 0.0,
                    "records": [record],
                    "log_tail": "",
                }
            )
            continue
        parts.append(runner(name, argv, limit))
        if impl and out_of_memory(parts[-1]):
            exhausted.add(impl)
    return parts


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    """The tables of gpu_kit.md."""
    env = report["environment"]
    lines = [
        f"# GPU kit: {env.get('device', '?')}",
        "",
        f"`{report['command']}`, {report['seconds']} s; torch {env.get('torch', '?')}, "
        f"TransformerEngine {'yes' if env.get('transformer_engine') else 'no'}.",
        "",
        "| part | return code | seconds |",
        "|---|---|---:|",
    ]
    lines += [f"| {p['part']} | {p['returncode']} | {p['seconds']} |" for p in report["parts"]]
    parts = {p["part"]: p for p in report["parts"]}
    if "checks" in parts:
        lines += [
            "",
            "## (a) the actor against Hugging Face",
            "",
            "| check | family | dtype | result |",
            "|---|---|---|---|",
        ]
        for r in parts["checks"]["records"]:
            if r.get("check") == "environment":
                continue
            lines.append(f"| {r.get('check')} | {r.get('family')} | {r.get('dtype')} | {_check_result(r)} |")
    steps = [r for name, p in parts.items() if name.startswith("step_") for r in p["records"]]
    if steps:
        lines += [
            "",
            "## (b) a train step by attention implementation",
            "",
            "| attention | tokens / micro-batch | tokens / step | step (s) | tokens/s | MFU | peak memory (GiB) | "
            "first step loss / grad norm |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in steps:
            impl = r["attention_impl"] + (" + full recompute" if r.get("recompute") else "")
            head = f"| {impl} | {r['tokens_per_micro_batch']} | {r['tokens_per_step']} |"
            if "error" in r:
                lines.append(f"{head} {_short_error(r['error'])} | | | | |")
                continue
            first = r.get("first_step") or {}
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            lines.append(
                f"{head} {r['step_s']} | {r['tokens_per_s']} | {mfu} | {r['peak_memory_gib']} ({r['memory']}) | "
                f"{_fmt(first.get('loss'), 6)} / {_fmt(first.get('grad_norm'), 6)} |"
            )
    if "loop" in parts:
        lines += [
            "",
            "## (c) the loop, colocated on one device, without Ray",
            "",
            "| step | weight_version | rollout/weight_version | train/train_rollout_logprob_abs_diff | time/sync_s | "
            "rollout (s) | train (s) | reward | loss | grad norm |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in parts["loop"]["records"]:
            lines.append(
                f"| {r['step']} | {r['weight_version']} | {','.join(r['rollout/weight_version'])} | "
                f"{_fmt(r['train/train_rollout_logprob_abs_diff'])} | {r['time/sync_s']} | {r['time/rollout_s']} | "
                f"{r['time/train_s']} | {r['reward']} | {_fmt(r['loss'], 5)} | {_fmt(r['grad_norm'], 5)} |"
            )
    failed = [p for p in report["parts"] if p["returncode"] != 0]
    for p in failed:
        lines += ["", f"### {p['part']} failed ({p['returncode']})", "", "```", p["log_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _check_result(record: dict) -> str:
    if "error" in record:
        return f"error: {record['error'][:120]}"
    if record["check"] == "parity":
        return f"max abs logit diff {_fmt(record['max_abs_logit_diff'])}"
    if record["check"] == "log_probs":
        return f"max abs diff vs HF {_fmt(record['max_abs_diff_vs_hf'])}"
    if record["check"] == "gather":
        return f"{record['tensors']} tensors, max abs diff {_fmt(record['max_abs_diff'])}"
    if record["check"] == "attention":
        return (
            f"packed vs local: logits {_fmt(record['max_abs_logit_diff'])}, log-probs "
            f"{_fmt(record['max_abs_log_prob_diff'])}, gradients {_fmt(record['max_abs_grad_diff'])} "
            f"(largest gradient {_fmt(record['max_abs_grad'])})"
        )
    if record["check"] == "train":
        last = record["steps"][-1]
        exact = record.get("offload", {}).get("bit_exact_after_onload")
        return (
            f"step 4 loss {_fmt(last['loss'], 6)}, grad norm {_fmt(last['grad_norm'], 6)}; bit-exact hand-over {exact}"
        )
    return json.dumps(record)[:120]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU: the kit's own check")
    parser.add_argument("--out", default="gpu_kit", help="folder for gpu_kit.json and gpu_kit.md")
    parser.add_argument("--budgets", default=None, help="tokens per micro-batch of part (b), comma-separated")
    parser.add_argument("--skip", default="", help="parts to leave out, comma-separated: checks, step, loop")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    parts = run_plan(plan(args.cpu, args.budgets, skip))
    environment = next(
        (
            r
            for p in parts
            if p["part"] in ("checks", "environment")
            for r in p["records"]
            if r.get("check") == "environment"
        ),
        {},
    )
    report = {
        "command": "python -m benchmarks.gpu_kit" + (" --cpu" if args.cpu else ""),
        "seconds": round(time.perf_counter() - started, 1),
        "environment": environment,
        "parts": parts,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kit.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_kit.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(p["returncode"] == 0 for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
