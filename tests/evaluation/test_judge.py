"""The LLM judge against a local OpenAI-compatible stand-in: only EM's misses are asked, verdicts are cached, what
it cost is counted, and what it could not judge is said, never taken for a "no"."""

import json

import httpx
import pytest

from slime_search import eval as eval_cli
from slime_search.evaluation.judge import parse_verdict, question_of
from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

STANDIN = [str(REPO_ROOT / "tests" / "evaluation" / "openai_standin.py"), "--port", "0", "--api-key", "k"]
ANSWERS = {  # the candidate answer -> (golden answers, what the table should make of it)
    "Barack Obama": (["Barack Obama"], "EM hit: accepted without asking"),
    "the 44th president Barack Obama": (["Barack Obama"], "a miss the judge accepts"),
    "Paris": (["Lyon"], "a miss the judge rejects"),
    "flaky": (["x"], "accepted after one retry"),
    "broken": (["x"], "unjudged: the endpoint fails"),
    "chatty": (["x"], "unjudged: the reply is not yes or no"),
}


def write_trajectories(path):
    rows = [
        {"dataset": "nq", "prompt": f"Question: question {i}?", "response": f"<answer> {answer} </answer>",
         "golden_answers": golds}
        for i, (answer, (golds, _)) in enumerate(ANSWERS.items())
    ]  # fmt: skip
    rows.append({"dataset": "nq", "prompt": "Question: q?", "response": "I do not know", "golden_answers": ["y"]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_judge_grades_the_misses_once_and_says_what_it_could_not(tmp_path, monkeypatch, capsys):
    write_trajectories(tmp_path / "t.jsonl")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    with ServerProcess(STANDIN) as standin:
        argv = ["--grade", str(tmp_path / "t.jsonl"), "--judge-url", f"{standin.url}/v1", "--judge-model", "m",
                "--judge-usd-per-million-input", "1000000", "--output", str(tmp_path / "out" / "graded.json")]  # fmt: skip
        assert eval_cli.main(argv) == 0
        calls = httpx.get(f"{standin.url}/calls").json()["calls"]
        first = capsys.readouterr().out
        assert eval_cli.main(argv) == 0  # again: every verdict it got is in the cache beside the output
        second = capsys.readouterr().out
        again = httpx.get(f"{standin.url}/calls").json()["calls"] - calls
    # asked: the three misses with an answer that the endpoint judged, flaky twice, broken three times, chatty once
    assert calls == 1 + 1 + 2 + 3 + 1
    assert "judge m: 3 asked, 0 from the cache" in first and "2 failed" in first
    assert "HTTP 500" in first and "not yes or no" in first
    assert "0 asked, 3 from the cache" in second and again == 3 + 1  # only the two it could not judge are asked again
    table = json.loads((tmp_path / "out" / "graded.table.json").read_text())
    # judged: the hit, the 44th president, Paris, flaky and the answerless one; broken and chatty unjudged
    assert table["nq"]["judge"]["mean"] == pytest.approx(3 / 5) and table["nq"]["judge_unjudged"] == 2
    assert table["nq"]["em"]["mean"] == pytest.approx(1 / 7)
    metrics = json.loads((tmp_path / "out" / "graded.json").read_text())
    assert metrics["eval/judge_failed"] == 2.0 and metrics["eval/judge_cached"] == 3.0
    assert "| EM or judge [95% interval] | 0.600 [" in (tmp_path / "out" / "graded.table.md").read_text()
    assert (tmp_path / "out" / "graded.judge.sqlite").is_file()


def test_a_refused_key_leaves_every_miss_unjudged_and_says_why(tmp_path, monkeypatch, capsys):
    write_trajectories(tmp_path / "t.jsonl")
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    with ServerProcess(STANDIN) as standin:
        argv = ["--grade", str(tmp_path / "t.jsonl"), "--judge-url", f"{standin.url}/v1", "--judge-model", "m",
                "--judge-api-key-env", "JUDGE_KEY", "--judge-cache", str(tmp_path / "c.sqlite")]  # fmt: skip
        assert eval_cli.main(argv) == 0
        assert httpx.get(f"{standin.url}/calls").json()["calls"] == 0  # a 401 is not retried, nor counted as a call
    out = capsys.readouterr().out
    assert "0 asked" in out and "5 failed" in out and "HTTP 401" in out


def test_the_judge_flags_and_replies_are_checked(capsys):
    assert parse_verdict("Yes.") is True and parse_verdict(" no") is False
    for reply in ("", "maybe", "I think so"):
        with pytest.raises(ValueError, match="not yes or no"):
            parse_verdict(reply)
    assert question_of("<|im_start|>user\nQuestion: who?<|im_end|>\n<|im_start|>assistant\n") == "who?"
    with pytest.raises(SystemExit):
        eval_cli.main(["--grade", "x.jsonl", "--judge-url", "http://127.0.0.1:9/v1"])
    assert "--judge-url needs --judge-model" in capsys.readouterr().err
