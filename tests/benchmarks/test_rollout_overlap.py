"""The step-throughput benchmark drives the real driver loop (slime_search.run.loop.run_steps) in all three modes: at
its smallest size it runs and prints its table, so a change of the driver's interface cannot break it unseen."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.perf import rollout_overlap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.skipif(
    not (rollout_overlap.SHARED / "trajectories").is_dir(),
    reason=f"needs the Search-R1 data under {rollout_overlap.SHARED}",
)
def test_the_benchmark_runs_every_mode_at_its_smallest_size(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    flags = ["--prompts", "2", "--samples", "2", "--steps", "2", "--time-scale", "0.02", "--concurrency", "8"]
    before = set(Path(tempfile.gettempdir()).glob("bench-overlap-*"))
    assert rollout_overlap.main([*flags, "--json", str(out)]) == 0
    assert set(Path(tempfile.gettempdir()).glob("bench-overlap-*")) == before  # its work folder is removed
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"off", "one-step", "fully"}
    assert all(r["steps"] == 2 and r["trajectories_per_s"] > 0 for r in results.values())
    assert "| fully |" in capsys.readouterr().out
    for r in results.values():  # the engine's time, accounted: busy, nothing to decode, paused, running late
        assert min(r["engine_idle_s"], r["engine_paused_s"], r["engine_late_s"], r["engine_max_lag_s"]) >= 0
        assert 0 < r["engine_busy_fraction"] <= rollout_overlap.busy_where_it_could_work(r)


def test_busy_where_it_could_work_leaves_out_the_emulators_late_steps():
    result = {"emulated_s": 100.0, "engine_busy_fraction": 0.72, "engine_late_s": 20.0}
    assert rollout_overlap.busy_where_it_could_work(result) == pytest.approx(0.9)
