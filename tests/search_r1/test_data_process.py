"""The Search-R1 data scripts: schema, byte-identical prompts, and clear errors."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from slime_search.search_r1.prompt import make_prompt, make_row
from tests.conftest import REPO_ROOT

SCRIPTS = REPO_ROOT / "examples" / "search-r1" / "data_process"


def run_script(name, *args, env=None):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_make_prompt_is_search_r1_template():
    prompt = make_prompt("  who wrote hamlet ")
    assert prompt.startswith("Answer the given question. You must conduct reasoning inside <think> and </think> first")
    assert "You can search as many times as your want. " in prompt
    assert prompt.endswith("For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n")
    assert make_prompt("is it?").endswith("Question: is it?\n")
    with pytest.raises(ValueError, match="valid: base"):
        make_prompt("q", template="chat")


def test_train_merge_from_local_jsonl(tmp_path):
    nq = write_jsonl(tmp_path / "nq.jsonl", [{"id": "train_0", "question": "who is x", "golden_answers": ["X"]}])
    hotpot = write_jsonl(
        tmp_path / "hotpot.jsonl",
        [
            {"id": "h0", "question": "Is A B?", "golden_answers": ["yes"]},
            {"id": "h1", "question": "where is y", "golden_answers": "Y town"},
        ],
    )
    out = tmp_path / "out"
    result = run_script(
        "qa_search_train_merge.py",
        "--local-dir",
        str(out),
        "--local-jsonl",
        f"nq={nq}",
        "--local-jsonl",
        f"hotpotqa={hotpot}",
    )
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert rows[0] == {
        "id": "train_0",
        "question": "who is x?",
        "golden_answers": ["X"],
        "data_source": "nq",
        "prompt": [{"role": "user", "content": make_prompt("who is x")}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["X"]}},
        "extra_info": {"split": "train", "index": 0},
    }
    assert [r["data_source"] for r in rows] == ["nq", "hotpotqa", "hotpotqa"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 0, 1]  # per source, as Search-R1
    assert rows[2]["reward_model"]["ground_truth"]["target"] == ["Y town"]


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda d: ["--local-jsonl", str(d)], "no local file for 'nq'"),
        (lambda d: ["--local-jsonl", f"nq={d / 'missing.jsonl'}", "--data-sources", "nq"], "does not exist"),
        (
            lambda d: ["--local-jsonl", f"nq={write_jsonl(d / 'bad.jsonl', [{'id': 1}])}", "--data-sources", "nq"],
            "lacks field 'question'",
        ),
        (
            lambda d: [
                "--local-jsonl",
                f"nq={write_jsonl(d / 'e.jsonl', [{'id': 'q7', 'question': ' ', 'golden_answers': []}])}",
                "--data-sources",
                "nq",
            ],
            "'q7': empty question",
        ),
    ],
)
def test_bad_input_gives_one_clear_line(tmp_path, setup, message):
    result = run_script("qa_search_train_merge.py", "--local-dir", str(tmp_path / "out"), *setup(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text('{"id": "a", "question": "q", "golden_answers": ["x"]}\n{not json\n')
    result = run_script(
        "qa_search_train_merge.py", "--local-dir", str(tmp_path), "--local-jsonl", f"nq={path}", "--data-sources", "nq"
    )
    assert result.returncode == 2 and f"{path}:2: not valid JSON" in result.stderr


def test_offline_hub_fails_with_one_line(tmp_path):
    result = run_script("qa_search_test_merge.py", "--local-dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "cannot load 'nq' from the Hugging Face hub" in result.stderr and "--local-jsonl" in result.stderr
    assert "Traceback" not in result.stderr


def test_test_merge_prompts_are_byte_identical_to_search_r1(shared_data, tmp_path):
    result = run_script(
        "qa_search_test_merge.py", "--local-dir", str(tmp_path), "--local-jsonl", str(shared_data / "qa")
    )
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    by_source = {}
    for row in rows:
        by_source.setdefault(row["data_source"], {})[row["id"]] = row
    assert list(by_source) == ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
    assert len(by_source["nq"]) == 3610 and len(by_source["bamboogle"]) == 125
    compared = 0
    for name in ("nq", "triviaqa", "popqa", "bamboogle"):
        for line in (shared_data / "trajectories" / f"search_r1_3b_base_{name}.jsonl").open():
            traj = json.loads(line)
            row = by_source[name][traj["id"]]
            # The prompts Search-R1 itself produced for these questions, compared byte for byte.
            assert row["prompt"][0]["content"] == traj["prompt"], traj["id"]
            assert row["reward_model"]["ground_truth"]["target"] == traj["golden_answers"]
            compared += 1
    assert compared == 3125
    assert make_row({"question": "q", "golden_answers": ["a"]}, "nq", "test", 5)["id"] == "test_5"
