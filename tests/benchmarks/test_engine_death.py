"""The engine-death benchmark at its smallest size: a tiny miniature (every phase a few steps), its RL phase run with
two CPU engines undisturbed and with one killed after the first step; the table of both runs printed."""

import json

import pytest

from benchmarks.engine_death import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_both_runs_complete_and_the_killed_engine_is_restarted(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path / "run"), "--kill-after-step", "1", "--smallest"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n}\n") + 2])
    base, killed = results["undisturbed"], results["one engine killed"]
    assert base["steps"] == killed["steps"] == 3  # SMALLEST's RL_STEPS: the death cost no step
    assert results["killed_at_s"] is not None and killed["restarts"] == 1 and base["restarts"] == 0
    assert killed["engine_errors"] == 0  # no trajectory lost to the dead engine
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in table[1:]] == ["| undisturbed", "| one engine killed"]  # after the header
    assert "cost of the death:" in out
