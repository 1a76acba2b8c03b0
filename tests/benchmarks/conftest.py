"""What the benchmarks' smoke tests share: one miniature prepared up to its RL phase, at the smallest size."""

import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def smallest_sft_start(tmp_path_factory) -> Path:
    """A miniature at `miniature_runs.SMALLEST` with every phase before RL done (task, policy, index, SFT: the run
    script with STOP_AFTER=sft), made once for the smoke runs that start RL runs from it. Use `copy_of`."""
    from benchmarks.harness.miniature_runs import script_env
    from benchmarks.harness.paths import MINIATURE_SCRIPT as SCRIPT

    run_dir = tmp_path_factory.mktemp("smallest_sft_start") / "run"
    env = script_env(run_dir, smallest=True, STOP_AFTER="sft")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all((run_dir / f".done-{phase}").is_file() for phase in ("task", "policy", "index", "sft"))
    assert not (run_dir / "rl").exists()  # stopped before RL
    return run_dir


def copy_of(prepared: Path, to: Path) -> Path:
    """A test's own copy of a prepared run folder (its RL runs and logs then stay its own)."""
    shutil.copytree(prepared, to)
    return to
