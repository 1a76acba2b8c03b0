"""The Serper cache benchmark at its smallest size: a few recorded Search-R1 trajectories replayed through the real
generate plugin against the Serper stand-in (a real HTTP server on 127.0.0.1), once recording into the cache and
once from the cache alone; the second pass bills nothing and sees the same observations. Nothing is left behind."""

import json
import tempfile
from pathlib import Path

import pytest

from benchmarks.harness.baselines import check_baselines
from benchmarks.perf.serper_cache import main
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)
KEY = "bench-cache-key"


def test_a_replayed_pass_bills_nothing_and_sees_what_the_recorded_pass_saw(shared_data, monkeypatch, capsys):
    trajectories = shared_data / "trajectories" / "search_r1_3b_base_nq.jsonl"
    standin = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", KEY]
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    before = set(Path(tempfile.gettempdir()).glob("bench-serper-*"))
    with ServerProcess(standin) as serper:
        argv = ["--serper-url", f"{serper.url}/search", "--trajectories", str(trajectories), "--num-trajectories", "4"]
        assert main([*argv, "--concurrency", "4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    record, replay, same = lines[-3:]
    assert record["pass"] == "record" and replay["pass"] == "replay-only"
    assert record["trajectories"] == replay["trajectories"] == 4 and record["failed"] == replay["failed"] == 0
    assert record["searches"] > 0 and record["billed_calls"] > 0
    assert replay["billed_calls"] == 0 and replay["cache_hits"] == replay["searches"] == record["searches"]
    assert same == {"identical_trajectories": 4, "of": 4}
    figures = {f"{line['pass']}/{name}": line[name] for line in (record, replay) for name in ("billed_calls", "failed")}
    figures |= {"replay-only/hit_rate": replay["hit_rate"], "identical_trajectories": same["identical_trajectories"]}
    check_baselines("serper_cache --num-trajectories 4 --concurrency 4", figures)
    assert set(Path(tempfile.gettempdir()).glob("bench-serper-*")) == before  # its folder is removed
