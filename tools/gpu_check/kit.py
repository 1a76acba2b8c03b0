"""One command that checks a bare GPU machine for what can still break on the 3B recipe's GPU path, and writes one
JSON and one markdown table.

    bash scripts/gpu_kit_wheels.sh wheels/          # where a network is: the wheels the GPU machine lacks (< 64 MiB)
    pip install --no-deps wheels/*.whl              # on the GPU machine, in the checkout
    python -m tools.gpu_check --out gpu_kit/     # one CUDA GPU: at most 6 minutes (the parts' limits)
    python -m tools.gpu_check --cpu --out gpu_kit/   # the same parts, the tiny model, on CPU

For one GPU with torch, Triton and transformers, megatron-core and the wheels above: no SGLang, TransformerEngine or
Ray. Each part is a process of its own with a time limit. A part that fails or overruns is recorded (return code,
log tail) and the others still run; the report is rewritten after each part. Every 3B part builds the actor from the
recipe's own flags (`DRY_RUN=1 bash examples/search-r1/run_qwen2.5_3B.sh`, `tools.gpu_check.shared`) at TP 1.
- checks: `tools.gpu_check.megatron_checks`, the actor against Hugging Face on the device (logits, packed log-probs,
  GRPO steps, the weight gather, the packed attention against the local one), tiny Qwen2 and Qwen3;
- recipe_step: `tools.gpu_check.recipe`, the recipe's step (old and reference log-probs, the update) on
  Qwen2.5-3B: seconds, peak memory against the card's;
- handover: `tools.gpu_check.handover`, the colocated hand-over of the 3B actor and reference, twice: seconds,
  host memory, device memory freed, state byte for byte;
- gather: `tools.gpu_check.gather`, the push's weight gather on the 3B state: seconds, peak memory;
- ipc: `tools.gpu_check.ipc`, the tensor transport's buckets between two processes over CUDA IPC, 3 pushes:
  data read right, memory back to its baseline after every bucket;
- checkpoint: `tools.gpu_check.checkpoint`, convert, train, save, resume on the tiny model: bit-identical steps,
  file sizes.
Every part records the installed distributions it imported (`distributions`), so the report names the versions it
ran with and a test holds the wheel list to them. Writes OUT/gpu_kit.json and OUT/gpu_kit.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# (part, module, seconds it may take on one CUDA GPU): the limits sum to 360, two kit runs and two machine starts in
# a 15-minute lease. Measured or estimated per part in docs/gpu.md.
PARTS = (
    ("checks", "tools.gpu_check.megatron_checks", 65),
    ("recipe_step", "tools.gpu_check.recipe", 70),
    ("handover", "tools.gpu_check.handover", 100),  # pins the host buffers of the 57 GiB state first
    ("gather", "tools.gpu_check.gather", 45),
    ("ipc", "tools.gpu_check.ipc", 40),
    ("checkpoint", "tools.gpu_check.checkpoint", 40),
)
CPU_LIMIT_S = 240  # a shared 2-core CI machine
IMPORT_LINE = "import time:"


def imported_distributions(stderr: str) -> dict[str, str]:
    """The installed distributions (name -> version) whose modules a part imported, read from the import lines
    PYTHONPROFILEIMPORTTIME writes; the standard library and the checkout's own packages are left out."""
    owners = importlib.metadata.packages_distributions()
    shipped: dict[str, set[str]] = {}  # distribution -> the module paths it installs, read once
    found = {}
    for line in stderr.splitlines():
        if not line.startswith(IMPORT_LINE):
            continue
        module = line.rsplit("|", 1)[-1].strip()
        candidates = owners.get(module.split(".")[0], [])
        if len(candidates) > 1:  # a namespace (google, opentelemetry): only the distributions holding this module
            candidates = [name for name in candidates if _ships(name, module, shipped)]
        for name in candidates:
            if name not in found and name != "slime-search":
                with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                    found[name] = importlib.metadata.version(name)
    return dict(sorted(found.items()))


MODULE_SUFFIXES = (".py", ".so", ".pyd")  # a module's source, or its compiled extension (_message.abi3.so)


def _ships(distribution: str, module: str, shipped: dict[str, set[str]]) -> bool:
    """Whether `distribution` installs `module`: a package folder of it, or a source or extension module by that
    dotted name."""
    if distribution not in shipped:
        modules = set()
        for path in importlib.metadata.files(distribution) or []:
            if path.suffix in MODULE_SUFFIXES:
                modules.add(".".join(path.parent.parts))
                modules.add(".".join((*path.parent.parts, path.name.split(".", 1)[0])))
        shipped[distribution] = modules
    return module in shipped[distribution]


def run_part(name: str, argv: list[str], timeout_s: float) -> dict:
    """Run `python -m argv...`; its stdout's JSON lines are its records. A timeout or a crash is recorded, not raised:
    the kit's point is to report what works and what does not."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # the part's imports, children included, on its stderr
    # a session of its own: on a timeout the part's whole process group goes (a spawned consumer with it)
    process = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
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
    log = "\n".join(line for line in stderr.splitlines() if not line.startswith(IMPORT_LINE))
    return {
        "part": name,
        "argv": ["python", "-m", *argv],
        "returncode": returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "records": records,
        "distributions": imported_distributions(stderr),
        "log_tail": log[-3000:] if returncode != 0 else "",
    }


def plan(cpu: bool, skip: set[str]) -> list[tuple[str, list[str], float]]:
    """(part, module argv, time limit in seconds) in the order they run."""
    unknown = skip - {name for name, _, _ in PARTS}
    if unknown:
        raise SystemExit(f"--skip: unknown parts {sorted(unknown)}; the parts: {', '.join(n for n, _, _ in PARTS)}")
    planned = []
    for name, module, limit in PARTS:
        if name in skip:
            continue
        argv = [module, *(["--cpu"] if cpu and name != "checks" else [])]
        if cpu and name == "checks":
            argv += ["--families", "qwen2"]  # the checks run on CPU wherever CUDA is absent
        planned.append((name, argv, CPU_LIMIT_S if cpu else limit))
    if "checks" in skip:  # the tables still name the device and the software they were measured on
        planned.insert(0, ("environment", ["tools.gpu_check.megatron_checks", "--families", ""], 60))
    return planned


def environment_of(parts: list[dict]) -> dict:
    return next(
        (
            r
            for p in parts
            if p["part"] in ("checks", "environment")
            for r in p["records"]
            if r.get("check") == "environment"
        ),
        {},
    )


def write_report(out: Path, command: str, started: float, parts: list[dict]) -> str:
    from tools.gpu_check.report import markdown

    report = {
        "command": command,
        "seconds": round(time.perf_counter() - started, 1),
        "environment": environment_of(parts),
        "parts": parts,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kit.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "gpu_kit.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU: the kit's own check")
    parser.add_argument("--out", default="gpu_kit", help="folder for gpu_kit.json and gpu_kit.md")
    parser.add_argument(
        "--skip", default="", help="parts to leave out, comma-separated: " + ", ".join(p[0] for p in PARTS)
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    command = "python -m tools.gpu_check" + (" --cpu" if args.cpu else "")
    parts, table = [], ""
    for name, part_argv, limit in plan(args.cpu, set(filter(None, args.skip.split(",")))):
        parts.append(run_part(name, part_argv, limit))
        table = write_report(Path(args.out), command, started, parts)  # a run cut short keeps what it measured
    print(table)
    return 0 if all(p["returncode"] == 0 for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
