"""The 3B recipe's own flags, read from its run script rather than restated.

`DRY_RUN=1 bash examples/search-r1/run_qwen2.5_3B.sh` prints the training command the recipe would run; the model
scripts of `scripts/models/` hold each model's architecture flags.
"""

from __future__ import annotations

import os
import subprocess

from benchmarks.harness.paths import MODEL_SCRIPTS, RECIPE_SCRIPT

GPU_MODEL, CPU_MODEL = "qwen2.5-3B", "tiny-qwen2"  # files of scripts/models/


def recipe_flags(model_name: str, env: dict[str, str] | None = None) -> list[str]:
    """The flags of the training command the recipe script prints with DRY_RUN=1 for MODEL_NAME=`model_name` (and
    `env`, e.g. {"COLOCATE": "1"}): the lines after `python3 .../train.py`."""
    environment = {**os.environ, "DRY_RUN": "1", "MODEL_NAME": model_name, **(env or {})}
    done = subprocess.run(["bash", str(RECIPE_SCRIPT)], env=environment, capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    if len(lines) < 3 or not lines[1].endswith("train.py"):
        raise RuntimeError(f"{RECIPE_SCRIPT.name} with DRY_RUN=1 printed no training command: {done.stdout[:300]!r}")
    return lines[2:]


def model_flags(model_name: str) -> list[str]:
    """`${MODEL_ARGS[@]}` of scripts/models/`model_name`.sh, as the converter takes them."""
    script = f'source "{MODEL_SCRIPTS / model_name}.sh" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
