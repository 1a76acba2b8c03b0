"""The README starts a newcomer: at most 200 lines, the main job's command within the first 60, and every command it
shows run somewhere from a clean checkout: by CI itself (.ci/run), by a named test, or here when it is cheap. A command
added to the README without saying where it runs fails this test."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAIN_JOB = "bash examples/search-r1/run_miniature_cpu.sh"

# where each command of the README runs (a command is its text without a trailing comment)
BY_CI = {
    'pip install -c constraints.txt -e ".[cpu,dev]"',
    "bash tests/sglang_cpu/setup.sh",
    "ruff check . && ruff format --check . && python -m pytest -q",
}
BY_TEST = {  # command -> the test file that runs it (shortened where the whole would take too long for a test)
    MAIN_JOB: "tests/e2e/test_miniature_learning.py",
    "bash examples/search-r1/run_qwen2.5_3B.sh": "tests/test_arguments.py",  # DRY_RUN=1: its command line, parsed
    "python -m tools.gpu_check": "tests/tools/test_gpu_check.py",  # --cpu: every part on the tiny model on CPU
}
CHEAP = {  # command -> what runs here (the same command; a CLI with --help, which loads every module it needs)
    "python -m slime_search.train": [sys.executable, "-m", "slime_search.train", "--help"],
    "python -m slime_search.eval": [sys.executable, "-m", "slime_search.eval", "--help"],
}
QUICK_LOOP = 'python -m pytest -q -m "not slow"'  # the CI command's tests, less those marked slow
VENV = "python3.11 -m venv .venv && . .venv/bin/activate"


def readme_commands() -> list[str]:
    """The lines of the README's bash blocks, and its inline code that starts with a command."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        commands += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    commands += re.findall(r"`((?:python3?(?:\.\d+)?|bash|pip|ruff) [^`]*)`", text)
    return list(dict.fromkeys(commands))


def test_the_readme_is_short_and_shows_the_main_job_on_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    assert any(MAIN_JOB in line for line in lines[:60])


def test_every_command_of_the_readme_says_where_it_runs():
    commands = readme_commands()
    assert MAIN_JOB in commands and len(commands) >= 8  # the parse found the README's commands
    placed = BY_CI | set(BY_TEST) | set(CHEAP) | {QUICK_LOOP, VENV}
    assert [command for command in commands if command not in placed] == []


def test_ci_runs_the_readme_set_up_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")  # CI installs quietly
    assert [command for command in BY_CI if command not in ci] == []


def test_the_tests_that_run_the_readme_commands_run_them():
    for command, test in BY_TEST.items():
        words = command.split()
        if "-m" in words:  # a module: the test names it, and it is a package or a file of the checkout
            module = words[words.index("-m") + 1]
            assert module in (REPO / test).read_text(), (command, test)
            path = REPO / module.replace(".", "/")
            assert (path / "__main__.py").is_file() or path.with_suffix(".py").is_file(), module
        else:
            script = words[-1]
            assert Path(script).name in (REPO / test).read_text(), (command, test)
            assert (REPO / script).is_file(), script


def test_the_quick_loop_selects_by_a_marker_the_suite_declares():
    assert '"slow' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("command", sorted(CHEAP))
def test_the_cheap_commands_of_the_readme_run(command):
    done = subprocess.run(CHEAP[command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--hf-checkpoint" in done.stdout or "usage" in done.stdout.lower()


def test_the_readme_virtual_environment_command_makes_one(tmp_path):
    if shutil.which("python3.11") is None:
        pytest.skip("python3.11 is not on PATH here: the README's virtual environment command names it")
    done = subprocess.run(["bash", "-c", f"{VENV} && python -c 'import sys; print(sys.prefix)'"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path / ".venv")
