"""The async learning benchmark's wide evaluation judges each run as the run script's own evals do: the same task,
the same search settings; and its replica table's arithmetic."""

import json
import re
import shlex

import pytest

from benchmarks.harness import miniature_runs
from benchmarks.studies import async_modes
from slime_search.miniature.task import make_task, write_task

SCRIPT_TEXT = async_modes.SCRIPT.read_text()


def script_default(name: str) -> str:
    return re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", SCRIPT_TEXT, re.M).group(1)


def test_all_held_out_questions_extend_the_run_scripts_held_out_file(tmp_path):
    from slime_search.rollout.data_source import load_rows

    script_size = {"people": int(script_default("PEOPLE")), "companies": int(script_default("COMPANIES"))}
    assert script_size == async_modes.TASK_SIZE
    seed = 1
    limit = int(script_default("HELDOUT"))
    script_task = write_task(make_task(seed, **async_modes.TASK_SIZE), tmp_path / "task", heldout_limit=limit)
    everything = load_rows(async_modes.write_all_heldout(tmp_path, seed))
    assert load_rows(script_task / "heldout.parquet") == everything[:limit] and len(everything) > 8 * limit


def pairs(tokens: list[str]) -> dict[str, str | None]:
    """flag -> value (None for a switch) of an argument list."""
    out, flag = {}, None
    for token in tokens:
        if token.startswith("--"):
            out[flag := token] = None
        else:
            out[flag] = token
    return out


def test_wide_eval_searches_as_the_runs_do(tmp_path):
    from slime_search.eval import build_parser

    block = re.search(r"^SEARCH_ARGS=\((.*?)^\)", SCRIPT_TEXT, re.M | re.S).group(1)
    assert "TOOL_FORMAT=${TOOL_FORMAT:-tags}" in SCRIPT_TEXT
    block = block.replace('"${TOOL_FORMAT}"', "tags")  # the script's default, the format the benchmark's runs use
    script_flags = pairs(shlex.split(block))
    del script_flags["--search-url"]
    assert pairs(async_modes.EVAL_FLAGS) == script_flags

    arguments = async_modes.eval_arguments(tmp_path / "rl-off", 20, tmp_path / "h.parquet", "http://x/retrieve")
    parsed = build_parser().parse_args(arguments)  # every flag is one slime_search.eval takes
    assert parsed.hf_checkpoint == str(tmp_path / "rl-off" / "weights" / "step_20")
    assert parsed.max_turns == 2 and parsed.search_topk == 1 and parsed.rollout_max_response_len == 48


def test_replica_table_compares_each_mode_with_the_mean_of_synchronous_replicas():
    finals = {
        (0, "off", 0): 0.90, (0, "off", 1): 0.80,
        (0, "one-step", 0): 0.86, (0, "one-step", 1): 0.84,
        (0, "fully", 0): 0.70, (0, "fully", 1): 0.80,
    }  # fmt: skip
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in
            async_modes.replica_table(finals, [0], 2, ["off", "one-step", "fully"]).splitlines()}  # fmt: skip
    assert "| 0.850 | +0.000 | 0.100 |" in rows[("0", "off")]
    assert "| 0.850 | +0.000 | 0.020 |" in rows[("0", "one-step")]
    assert "| 0.750 | -0.100 | 0.100 |" in rows[("0", "fully")]
    assert "| 0.750 | -0.100 |" in rows[("all seeds", "fully")]


@pytest.mark.parametrize(("p", "n", "expected"), [(0.5, 100, 0.05), (0.9, 600, 0.0122), (1.0, 600, 0.0)])
def test_standard_error_of_an_exact_match_rate(p, n, expected):
    assert async_modes.standard_error(p, n) == pytest.approx(expected, abs=1e-4)


def test_replicas_sample_and_order_prompts_with_seeds_of_their_own(tmp_path):
    from slime_search.arguments import build_parser

    def parsed(mode: str, seed: int, replica: int):
        required = ["--hf-checkpoint", str(tmp_path), "--prompt-data", "x.parquet", "--save", str(tmp_path)]
        run_script = [*required, "--num-rollout", "1", "--rollout-batch-size", "8", "--seed", str(seed)]
        run_script += ["--rollout-seed", str(seed)]  # what run_miniature_cpu.sh passes before RL_ARGS
        return build_parser().parse_args([*run_script, *miniature_runs.run_flags(mode, 2, seed, replica).split()])

    first, third = parsed("fully", 2, 0), parsed("fully", 2, 2)
    assert (first.seed, first.rollout_seed, first.async_mode, first.max_staleness) == (2, 2, "fully", 2)
    assert third.seed == third.rollout_seed == miniature_runs.replica_seed(2, 2) != 2
    assert parsed("off", 2, 1).async_mode == "off"
    assert len({miniature_runs.replica_seed(seed, r) for seed in range(3) for r in range(5)}) == 15
    assert miniature_runs.run_name("fully", "5e-4", 0) == "rl-fully-lr5e-4"
    assert miniature_runs.run_name("fully", "5e-4", 3) == "rl-fully-lr5e-4-rep3"


def test_wide_eval_reads_the_eval_tools_metrics_once_written(tmp_path):
    """A run evaluated before is read, not evaluated again (no engine is started here: one would fail the test)."""
    (tmp_path / async_modes.WIDE_EVAL).write_text('{"eval/em": 0.85, "eval/n": 600.0, "eval/f1": 0.9}')
    assert async_modes.wide_eval(tmp_path, 20, tmp_path / "absent.parquet", "http://127.0.0.1:9/retrieve") == {
        "wide_em": 0.85,
        "wide_n": 600.0,
    }


def test_extra_args_reach_every_run_after_the_modes_own_flags():
    assert miniature_runs.run_flags("off", 2, 0, 0, "--save-interval 2") == "--async-mode off --save-interval 2"
    flags = miniature_runs.run_flags("fully", 2, 1, 3, "--no-health-guard").split()
    assert flags[-1] == "--no-health-guard" and flags[flags.index("--seed") + 1] == "3001"


def test_a_run_the_guard_stopped_is_a_result_evaluated_on_its_last_saved_weights(tmp_path):
    run = tmp_path / "rl-fully"
    for step in (2, 10, 4):
        (run / "weights" / f"step_{step}").mkdir(parents=True)
    assert not miniature_runs.stopped(run)
    arguments = async_modes.eval_arguments(run, 20, tmp_path / "h.parquet", "http://x/retrieve")
    assert arguments[arguments.index("--hf-checkpoint") + 1] == str(run / "weights" / "step_20")
    events = [
        {"step": 3, "action": "warn"},
        {"step": 4, "action": "watch"},  # a held-out fall the guard waited on: no warning
        {"step": 5, "action": "rollback", "values": {"since": 3.0}},  # the decision ...
        {"step": 5, "action": "rollback", "values": {"to_step": 2.0}},  # ... and the checkpoint gone back to
        {"step": 10, "action": "rollback", "values": {"since": 8.0}},  # a decision left without a rollback: a stop
        {"step": 10, "action": "stop"},
    ]
    (run / "health.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert miniature_runs.stopped(run)
    arguments = async_modes.eval_arguments(run, 20, tmp_path / "h.parquet", "http://x/retrieve")
    assert arguments[arguments.index("--hf-checkpoint") + 1] == str(run / "weights" / "step_10")  # not step_4
    assert miniature_runs.health_summary(run) == {
        "rollbacks": 1,
        "warnings": 1,
        "watches": 1,
        "stopped": 1.0,
        "ended_on_best": -1.0,
    }
    with pytest.raises(FileNotFoundError, match="no weights"):
        miniature_runs.final_weights(tmp_path / "empty")


def test_a_run_that_ended_on_its_best_checkpoint_is_evaluated_on_it(tmp_path):
    run = tmp_path / "rl-fully-rep1"
    (run / "weights" / "step_14").mkdir(parents=True)  # the disk transport's last push: the checkpoint ended on
    events = [{"step": 20, "action": "end_on_best", "rule": "late_decline", "values": {"ended_on": 14.0}}]
    (run / "health.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert miniature_runs.ended_on_best(run) == 14 and not miniature_runs.stopped(run)
    assert miniature_runs.health_summary(run)["ended_on_best"] == 14.0
    arguments = async_modes.eval_arguments(run, 20, tmp_path / "h.parquet", "http://x/retrieve")
    assert arguments[arguments.index("--hf-checkpoint") + 1] == str(run / "weights" / "step_14")


def test_the_health_table_counts_runs_ending_below_their_seeds_synchronous_mean():
    assert miniature_runs.deepest_dip([0.1, 0.8, 0.5, 0.9, 0.85]) == pytest.approx(0.3)
    assert miniature_runs.deepest_dip([0.1, 0.2, 0.3]) == 0.0

    def run(wide_em, curve=(0.1, 0.8), rollbacks=0, stopped=0.0):
        return {"wide_em": wide_em, "em_curve": list(curve), "rollbacks": rollbacks, "warnings": 2, "stopped": stopped}

    runs = {(0, "off", 0): run(0.90), (0, "off", 1): run(0.80), (0, "fully", 0): run(0.79, (0.1, 0.8, 0.0), 1, 1.0)}
    runs[(0, "fully", 1)] = run(0.81)
    text = async_modes.health_table(runs, [0], 2, ["off", "fully"])
    assert "| 0 | fully | 0 | 0.790 | -0.060 | 0.800 | 1 | 2 | yes |" in text
    assert "| 0 | fully | 1 | 0.810 | -0.040 | 0.000 | 0 | 2 | no |" in text
    assert "1 of 4 runs ended more than 0.05 below" in text  # the off run at 0.80 is 0.05 below its mean: not counted


def test_the_rl_runs_importance_weighting_is_tis_unless_is_args_replaces_it():
    """Every figure of the benchmarks is made with TIS; IS_ARGS (e.g. "--use-mis --mis-mode mask") replaces it, since
    train.py refuses the two together (tests/test_arguments.py)."""
    assert re.search(r'^read -r -a IS_EXTRA <<<"\$\{IS_ARGS:---use-tis\}"$', SCRIPT_TEXT, re.M)
    rl_command = SCRIPT_TEXT[SCRIPT_TEXT.index("--advantage-estimator grpo") :].split("\n\n")[0]
    assert '"${IS_EXTRA[@]}"' in rl_command and "--use-tis" not in rl_command


def test_twins_only_makes_the_asked_modes_runs_and_no_synchronous_ones(tmp_path, monkeypatch):
    """The unguarded twins of another folder: only their own runs are made (and evaluated on every question)."""
    made = []

    def run_mode(out, seed, mode, *rest):
        made.append((seed, mode, rest[3]))  # rest: max_staleness, steps, lr, replica, extra, eval_interval
        return tmp_path / f"{mode}-{rest[3]}"

    monkeypatch.setattr(async_modes, "run_mode", run_mode)
    monkeypatch.setattr(async_modes, "wide_evals", lambda out, seed, runs, steps: {m: {"wide_em": 0.9} for m in runs})
    monkeypatch.setattr(async_modes, "summary", lambda run: {"em_end": 0.9})
    argv = ["--out", str(tmp_path), "--seeds", "3", "--modes", "one-step", "fully", "--replicas", "2", "--wide-eval"]
    assert async_modes.main([*argv, "--twins-only"]) == 0
    assert made == [(3, "one-step", 0), (3, "fully", 0), (3, "one-step", 1), (3, "fully", 1)]
    with pytest.raises(SystemExit):
        async_modes.main(["--out", str(tmp_path), "--modes", "off", "fully", "--wide-eval", "--twins-only"])
    with pytest.raises(SystemExit):
        async_modes.main(["--out", str(tmp_path), "--modes", "fully", "--twins-only"])
