"""`python -m slime_search.eval` against a running engine (scripted turns) and a real BM25 retriever."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search import eval as eval_cli
from slime_search.search_r1.prompt import make_row
from slime_search.utils.server_process import ServerProcess
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.slow

SCRIPT = {
    "red otter": ["<think> look it up </think>\n<search> red otter </search>", "<answer> valley number 1 </answer>"],
    "blue falcon": ["<think> I know this </think>\n<answer> mountain </answer>"],
    "green lynx": ["<answer> valley number 18 </answer>"],
}


def test_eval_reports_em_and_search_rate_per_data_source(tiny_checkpoint, tmp_path):
    write_tiny_corpus(tmp_path / "corpus.jsonl")
    assert build_index.main(["--retriever-name", "bm25", "--corpus-path", str(tmp_path / "corpus.jsonl"),
                             "--save-dir", str(tmp_path)]) == 0  # fmt: skip
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    nq = [
        make_row({"question": "where does the red otter live", "golden_answers": ["valley number 1"]}, "nq", "test", 0),
        make_row(
            {"question": "where does the blue falcon live", "golden_answers": ["valley number 8"]}, "nq", "test", 1
        ),
    ]
    hotpot = [make_row({"question": "where does the green lynx live", "golden_answers": ["valley number 18"]},
                       "hotpotqa", "test", 0)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(nq), tmp_path / "nq.parquet")
    pq.write_table(pa.Table.from_pylist(hotpot), tmp_path / "hotpot.parquet")
    engine_argv = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_checkpoint),
                   "--script", str(tmp_path / "script.json"), "--port", "0"]  # fmt: skip
    retriever_argv = ["--retriever-name", "bm25", "--index-path", str(tmp_path / "bm25"),
                      "--corpus-path", str(tmp_path / "corpus.jsonl")]  # fmt: skip
    with RetrievalServerProcess(*retriever_argv) as retriever, ServerProcess(engine_argv) as engine:
        code = eval_cli.main([
            "--hf-checkpoint", str(tiny_checkpoint), "--engine-url", engine.url, "--apply-chat-template",
            "--eval-prompt-data", "nq", str(tmp_path / "nq.parquet"), "hotpotqa", str(tmp_path / "hotpot.parquet"),
            "--search-url", f"{retriever.url}/retrieve", "--output", str(tmp_path / "out" / "eval.json"),
        ])  # fmt: skip
    assert code == 0
    metrics = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert metrics["eval/nq/em"] == 0.5 and metrics["eval/nq/search_rate"] == 0.5 and metrics["eval/nq/n"] == 2
    assert metrics["eval/hotpotqa/em"] == 1.0 and metrics["eval/hotpotqa/search_rate"] == 0.0
    assert metrics["eval/em"] == 2 / 3
    samples = [json.loads(line) for line in (tmp_path / "out" / "eval.samples.jsonl").read_text().splitlines()]
    searched = next(s for s in samples if "red otter" in str(s["prompt"]))
    assert "The red otter lives in valley number 1 " in searched["response"]  # the retrieved passage is in it


def write_questions(path, count: int) -> None:
    rows = [
        make_row({"question": f"where does the red otter {i} live", "golden_answers": ["valley"]}, "nq", "test", i)
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def eval_argv(checkpoint, data, *extra):
    # the tiny random policy writes no search call in 4 tokens, so no retriever is needed at this address
    return ["--hf-checkpoint", str(checkpoint), "--eval-prompt-data", "nq", str(data), "--max-samples", "2",
            "--search-url", "http://127.0.0.1:9/retrieve", "--search-preflight-timeout", "0",
            "--rollout-max-response-len", "4", *extra]  # fmt: skip


def test_eval_keeps_the_engine_log_beside_the_output_and_removes_its_copies(tiny_checkpoint, tmp_path, capsys):
    write_questions(tmp_path / "nq.jsonl", 3)
    output = tmp_path / "out" / "eval.json"
    assert eval_cli.main(eval_argv(tiny_checkpoint, tmp_path / "nq.jsonl", "--output", str(output))) == 0
    logs = tmp_path / "out" / "eval.logs"
    assert (logs / "engine.log").is_file()  # the engine started for the evaluation left its log with the results
    assert list(logs.glob("*.jsonl")) == []  # the first-2-rows copy of the set is gone
    assert str(logs) in capsys.readouterr().err
    assert json.loads(output.read_text())["eval/nq/n"] == 2


def test_eval_without_output_removes_its_temporary_folder_unless_it_fails(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    write_questions(tmp_path / "nq.jsonl", 3)
    assert eval_cli.main(eval_argv(tiny_checkpoint, tmp_path / "nq.jsonl")) == 0
    assert list(tmp_path.glob("slime-search-eval-*")) == []
    capsys.readouterr()
    with pytest.raises(FileNotFoundError):
        eval_cli.main(eval_argv(tiny_checkpoint, tmp_path / "missing.jsonl"))
    [kept] = tmp_path.glob("slime-search-eval-*")
    assert f"evaluation failed; the engine logs are kept in {kept}" in capsys.readouterr().err
