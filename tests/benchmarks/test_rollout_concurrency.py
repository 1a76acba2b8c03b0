"""The rollout concurrency benchmark at its smallest size: four trajectories through the CPU engine (a tiny random
Qwen2) and a real BM25 retriever over a tiny corpus, and its figures printed."""

import json

import pytest

from benchmarks.perf.rollout_concurrency import main
from tests.retriever_helpers import write_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_trajectories_complete_and_the_figures_are_printed(tmp_path, capsys):
    write_tiny_corpus(tmp_path / "corpus.jsonl")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({"question": f"where does the red otter live {i}?"}) + "\n" for i in range(6))
    )
    assert main([
        "--engine", "cpu", "--trajectories", str(questions), "--corpus-path", str(tmp_path / "corpus.jsonl"),
        "--num-trajectories", "4", "--concurrency", "4", "--max-new-tokens", "8", "--max-turns", "2",
        "--max-response-tokens", "64",
    ]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["trajectories"] == 4 and report["concurrency"] == 4
    assert report["trajectories_per_s"] > 0 and report["turns_per_trajectory"] >= 1
    assert sum(report["statuses"].values()) == 4 and "failed" not in report["statuses"]
    assert report["retriever"] == "bm25"
    assert set(report["search_client_batching"]) == {"requests", "queries", "factor"}
