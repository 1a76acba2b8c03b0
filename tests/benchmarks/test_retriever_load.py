"""The retriever load benchmark, run small on a tiny BM25 index: every scenario prints its line and the server's
bounds show in them (413s for the flood, the slow connections closed)."""

import json

import pytest

from benchmarks.perf import retriever_load
from local_dense_retriever import build_index
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_runs_every_scenario_and_shows_the_bounds(tmp_path, capsys):
    docs = write_tiny_corpus(tmp_path / "corpus.jsonl")
    args = ["--retriever-name", "bm25", "--corpus-path", str(tmp_path / "corpus.jsonl"), "--save-dir", str(tmp_path)]
    assert build_index.main(args) == 0
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    rows = [{"response": f"<search> {d['contents'].split(chr(10))[0]} </search>"} for d in docs]
    (trajectories / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert retriever_load.main([
        "--index-path", str(tmp_path / "bm25"), "--corpus-path", str(tmp_path / "corpus.jsonl"),
        "--retriever-name", "bm25", "--queries-from", str(trajectories), "--seconds", "1", "--small-clients", "4",
        "--large-requests", "2", "--large-size", "15000", "--floods", "2", "--flood-mb", "20",
        "--slow-connections", "8", "--header-timeout", "1",
    ]) == 0  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    alone, beside = lines[0], lines[1]
    assert alone["ok"] > 0 and beside["ok"] > 0 and alone["p99_ms"] is not None
    assert lines[2]["large_requests"] == {"200": 2}
    [flood] = [line for line in lines if "bodies of 20 MB" in line.get("scenario", "")]
    assert set(flood["statuses"]) <= {"413", "RemoteProtocolError", "WriteError", "ReadError"} and flood["statuses"]
    [slow] = [line for line in lines if "slow_connections" in line]
    assert slow["closed"] == 8
    assert lines[-1]["server_alive_at_end"] is True
