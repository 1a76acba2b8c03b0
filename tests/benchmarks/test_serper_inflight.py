"""The in-flight sharing benchmark at its smallest size: one step of four recorded Search-R1 prompts x 5 samples in
lockstep through the real Serper client and the stand-in; sharing bills each distinct query once."""

import json
from pathlib import Path

import pytest

from benchmarks.harness.baselines import check_baselines
from benchmarks.perf.serper_inflight import load_trajectories, main, turns_of
from slime_search.search_r1.serper_cache import normalise_query

pytestmark = pytest.mark.timeout(300)


def test_turns_are_read_from_a_recorded_response():
    response = "<think> a </think> <search> first q </search>\n\n<information>Doc 1 <search> not one </search>"
    response += "</information> <search>second q</search>"
    assert [query for _, query in turns_of(response)] == ["first q", "second q"]


def test_a_step_of_agreeing_groups_bills_each_distinct_query_once_when_shared(shared_data, capsys):
    paths = sorted(str(p) for p in (shared_data / "trajectories").glob("*.jsonl"))
    argv = ["--trajectories", *paths, "--steps", "1", "--prompts-per-step", "4", "--jitter", "0", "--agreement", "1"]
    assert main(argv) == 0
    step, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines()[-2:])
    groups = load_trajectories([Path(p) for p in paths], 0)[:4]
    distinct = {normalise_query(query) for row in groups for _, query in row["turns"]}
    searching = sum(bool(row["turns"]) for row in groups)
    assert step["searches"] == 5 * sum(len(row["turns"]) for row in groups) == summary["searches"]
    assert summary["billed_shared"] == len(distinct)  # every duplicate in flight rode on one call
    assert step["saved"] >= 4 * searching  # at least the first query of each group: 5 sent at once, 1 billed
    assert step["billed_shared"] + step["shared"] <= step["searches"]
    figures = {name: summary[name] for name in ("billed_shared", "saved_fraction")}
    check_baselines("serper_inflight --steps 1 --prompts-per-step 4 --jitter 0 --agreement 1", figures)
