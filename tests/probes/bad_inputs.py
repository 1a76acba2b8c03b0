"""What a user sees for every bad input a training run can get: the message, the exit code, the time to the message and
the steps trained. On the CPU miniature (a run folder of examples/search-r1/run_miniature_cpu.sh with its task, policy,
BM25 index and SFT checkpoint), three GRPO steps from the SFT weights per case, and every numeric flag at 0 and -1.

    python -m tests.probes.bad_inputs --run-dir runs/miniature --out /tmp/bad-inputs [--cases nan inf ...] [--no-flags]

Prints a markdown table (docs/benchmarks/bad_inputs.md records it). It starts its own retriever (and kills only that
one, by its PID, for the case of a retriever dying mid-run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGINS = """
from slime_search.search_r1.reward import reward_func


def bad(value):
    async def reward(args, sample, **kwargs):
        good = await reward_func(args, sample, **kwargs)
        return {**good, "score": value} if sample.index % 8 == 3 else good
    return reward


nan_reward, inf_reward, none_reward = bad(float("nan")), bad(float("inf")), bad(None)


async def raising_reward(args, sample, **kwargs):
    if sample.index % 8 == 3:
        raise KeyError("the judge's answer has no 'verdict'")
    return await reward_func(args, sample, **kwargs)


async def timing_out_reward(args, sample, **kwargs):
    if sample.index % 8 == 3:
        raise TimeoutError("judge endpoint timed out after 30 s")
    return await reward_func(args, sample, **kwargs)


async def constant_reward(args, sample, **kwargs):
    return {**(await reward_func(args, sample, **kwargs)), "score": 0.0}
"""
CASES = {  # name -> (what, extra flags, kill the retriever after this many steps)
    "nan": ("reward NaN for 1 sample in 8", ["--custom-rm-path", "bad_plugins.nan_reward"], None),
    "inf": ("reward inf for 1 sample in 8", ["--custom-rm-path", "bad_plugins.inf_reward"], None),
    "none": ("reward None for 1 sample in 8", ["--custom-rm-path", "bad_plugins.none_reward"], None),
    "raising": ("reward plugin raises for 1 sample in 8", ["--custom-rm-path", "bad_plugins.raising_reward"], None),
    "timing-out": (  # a fault that passes: waited out, here for at most 72 s
        "reward plugin times out for 1 sample in 8, --health-max-outage-hours 0.02",
        ["--custom-rm-path", "bad_plugins.timing_out_reward", "--health-max-outage-hours", "0.02"],
        None,
    ),
    "nan-tolerated": (
        "reward NaN for 1 in 8, --max-reward-error-rate 0.2",
        ["--custom-rm-path", "bad_plugins.nan_reward", "--max-reward-error-rate", "0.2"],
        None,
    ),
    "constant": ("reward constant 0", ["--custom-rm-path", "bad_plugins.constant_reward"], None),
    "retriever-down": ("retriever down at start", ["--search-url", "http://127.0.0.1:9/retrieve"], None),
    "retriever-dies": (
        "retriever killed after step 1, --health-max-outage-hours 0.02",
        ["--num-rollout", "6", "--health-max-outage-hours", "0.02"],
        1,
    ),
}
NUMERIC_FLAGS = (
    "--rollout-concurrency", "--generation-concurrency", "--search-concurrency", "--search-topk",
    "--n-samples-per-prompt", "--rollout-batch-size", "--global-batch-size", "--max-tokens-per-gpu", "--cpu-engines",
    "--max-turns", "--max-response-tokens", "--search-timeout", "--engine-timeout", "--rollout-temperature",
    "--keep-checkpoints", "--save-interval", "--eval-interval", "--max-staleness", "--lr", "--tis-clip",
)  # fmt: skip
MESSAGE = re.compile(r"(run stopped: .*|preflight failed: .*|error: .*|health (?:warn|pause|skip|stop|rollback) .*)")


def base_command(run_dir: Path, out: Path, search_url: str) -> list[str]:
    """The miniature's GRPO run (run_miniature_cpu.sh's flags), three steps, no eval."""
    return [
        sys.executable, "-m", "slime_search.train",
        "--hf-checkpoint", str(run_dir / "policy"), "--load", str(run_dir / "sft" / "checkpoints"),
        "--prompt-data", str(run_dir / "task" / "train.parquet"), "--rollout-shuffle", "--save", str(out),
        "--actor-num-gpus-per-node", "1", "--max-tokens-per-gpu", "512",
        "--search-url", search_url, "--search-topk", "1", "--max-turns", "2", "--max-obs-tokens", "96",
        "--max-response-tokens", "192", "--rollout-max-response-len", "48", "--apply-chat-template",
        "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--use-tis", "--lr", "5e-4",
    ]  # fmt: skip


def steps_trained(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r.get("train/steps_applied", 0) > 0 for r in records if "time/step_s" in r)


def first_message(output: str) -> str:
    """The line that tells the user what happened (the stop, the usage error), else the first health event."""
    lines = [m.group(1) for m in MESSAGE.finditer(output)]
    final = [line for line in lines if not line.startswith("health ")]
    return (final or lines or ["(none)"])[-1 if final else 0]


def run_case(command: list[str], env: dict, kill_after: int | None, retriever, out: Path) -> dict:
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        if kill_after is not None:
            while steps_trained(out) < kill_after and proc.poll() is None:
                time.sleep(0.5)
            retriever.stop()
        proc.wait(timeout=900)
    output = out.with_suffix(".log").read_text(errors="replace")
    return {
        "exit": proc.returncode,
        "seconds": time.perf_counter() - started,
        "steps": steps_trained(out),
        "message": first_message(output),
    }


def flag_case(flag: str, value: str, base: list[str], env: dict) -> dict:
    started = time.perf_counter()
    result = subprocess.run([*base, flag, value], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    message = first_message(result.stdout + result.stderr)
    if message.startswith("preflight failed"):  # the value passed the parser: the command went on to its retriever
        message = "accepted: a valid value (the command went on to its start-up checks)"
    return {"exit": result.returncode, "seconds": time.perf_counter() - started, "steps": 0, "message": message}


def table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| bad input | what the user sees | exit | time to it (s) | steps trained |", "|---|---|---|---|---|"]
    for what, r in rows:
        message = r["message"].replace("|", "\\|")
        lines.append(f"| {what} | {textwrap.shorten(message, 220)} | {r['exit']} | {r['seconds']:.1f} | {r['steps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from local_dense_retriever.launch import RetrievalServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a miniature run folder (task, policy, sft)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-flags", action="store_true", help="leave out the numeric flags at 0 and -1")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bad_plugins.py").write_text(PLUGINS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.out), str(REPO_ROOT)])}
    index = ["--retriever-name", "bm25", "--index-path", str(args.run_dir / "index" / "bm25")]
    corpus = ["--corpus-path", str(args.run_dir / "task" / "corpus.jsonl"), "--topk", "1"]
    rows = []
    for name in args.cases:
        what, flags, kill_after = CASES[name]
        with RetrievalServerProcess(*index, *corpus) as retriever:
            command = [*base_command(args.run_dir, args.out / name, f"{retriever.url}/retrieve"), *flags]
            rows.append((what, run_case(command, env, kill_after, retriever, args.out / name)))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not args.no_flags:
        base = base_command(args.run_dir, args.out / "flags", "http://127.0.0.1:9/retrieve")
        for flag in NUMERIC_FLAGS:
            for value in ("0", "-1"):
                rows.append((f"`{flag} {value}`", flag_case(flag, value, base, env)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
