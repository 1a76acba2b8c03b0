"""The engine-death benchmark at its smallest size: a tiny miniature (every phase a few steps, prepared up to RL once
for the package's smoke runs), its RL phase run with two CPU engines undisturbed and with one killed after the first
step; the table of both runs printed.

It is also the end-to-end test of the failover: an engine killed during a run costs no step, its trajectories move to
the other engine, the dead engine is found after the rollout, started again on its address while the actor trains,
and takes the next weight push with the other (every push checks that every engine serves the new version, and every
rollout that all its turns saw one version)."""

import json

import pytest

from benchmarks.studies.engine_death import main, records
from tests.benchmarks.conftest import copy_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_both_runs_complete_and_the_killed_engine_is_restarted(smallest_sft_start, tmp_path, capsys):
    run_dir = copy_of(smallest_sft_start, tmp_path / "run")
    assert main(["--run-dir", str(run_dir), "--kill-after-step", "1", "--smallest"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n}\n") + 2])
    base, killed = results["undisturbed"], results["one engine killed"]
    assert base["steps"] == killed["steps"] == 3  # SMALLEST's RL_STEPS: the death cost no step
    assert results["killed_at_s"] is not None and killed["restarts"] == 1 and base["restarts"] == 0
    assert killed["engine_errors"] == 0  # no trajectory lost to the dead engine
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in table[1:]] == ["| undisturbed", "| one engine killed"]  # after the header
    assert "cost of the death:" in out

    run = run_dir / "rl-2engines-kill"
    train = [r for r in records(run) if "train/loss" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert [r["weight_version"] for r in train] == [1, 2, 3]  # every engine served it after each push
    assert [r["rollout/weight_version"] for r in train] == [0, 1, 2]
    assert all(r["rollout/engine_errors"] == 0 for r in train)
    restarted = next(r for r in train if r["engines/restarted"])
    assert restarted["step"] >= 1 and restarted["time/engine_restart_wait_s"] >= 0
    assert "serving on" in next(run.glob("engine-*.restart1.log")).read_text()
