"""The retriever throughput benchmark at its smallest size on a tiny MiniLM index: every scenario prints its line,
the answers under load equal an exact in-process search, and the robustness round gets 200 for every valid request
and 4xx for every malformed one. Side by side with a stand-in for Search-R1's server (their module's names, our
search), both are driven round after round and their top-1 answers agree."""

import json
from pathlib import Path

import pytest

from benchmarks.perf.retriever_throughput import main
from local_dense_retriever import build_index
from tests.retriever_helpers import minilm_path, write_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STANDIN = Path(__file__).with_name("search_r1_standin.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("throughput")
    docs = write_tiny_corpus(root / "corpus.jsonl")
    common = ["--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main([*common, "--retriever-name", "minilm", "--retriever-model", minilm_path()]) == 0
    trajectories = root / "trajectories"
    trajectories.mkdir()
    rows = [{"response": f"<search> {d['contents'].split(chr(10))[1]} </search>"} for d in docs]
    (trajectories / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "--index-path", str(root / "minilm_Flat.index"), "--corpus-path", str(root / "corpus.jsonl"),
        "--queries-from", str(trajectories), "--num-queries", "16", "--single-client-queries", "4",
        "--concurrency", "8",
    ]  # fmt: skip


def lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_every_scenario_prints_its_figures_and_the_answers_are_exact(tiny, capsys):
    assert main([*tiny, "--batch", "4", "--robust-requests", "60", "--robust-concurrency", "8"]) == 0
    out = lines(capsys.readouterr().out)
    scenarios = [line for line in out if "scenario" in line]
    assert [s["requests"] for s in scenarios[:3]] == [4, 16, 4] and all(s["queries_per_s"] > 0 for s in scenarios)
    assert all(s["errors"] == 0 for s in scenarios[:3])
    [exact] = [line for line in out if "check" in line]
    assert exact["same"] == exact["of"] == 16
    rounds = [line["robustness"] for line in out if "robustness" in line]
    assert len(rounds) == 2
    for counts in rounds:
        assert counts["valid_200"] == counts["valid"] > 0 and counts["malformed_4xx"] == counts["malformed"] > 0
        assert counts["5xx"] == counts["connection_errors"] == 0
    assert out[-1] == {"server_alive_at_end": True}


def test_side_by_side_rounds_drive_both_servers_with_the_same_queries(tiny, capsys):
    assert main([*tiny, "--search-r1-server", str(STANDIN), "--rounds", "2", "--load-passes", "2"]) == 0
    out = lines(capsys.readouterr().out)
    scenarios = [(line["server"], line["requests"], line["ok"]) for line in out if "scenario" in line]
    ours_first = [("ours", 4, 4), ("ours", 32, 32), ("search-r1", 4, 4), ("search-r1", 32, 32)]  # 2 passes of 16
    assert scenarios == ours_first + ours_first[2:] + ours_first[:2]  # the order alternates
    rounds = [line for line in out if "round" in line]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["8_clients_qps_ratio"] > 0 for r in rounds)
    [agreement] = [line for line in out if "ours vs search-r1" in line.get("check", "")]
    assert agreement["same"] + agreement["near_ties"] == 16 and agreement["different"] == 0
    assert out[-1] == {"servers_alive_at_end": [True, True]}
