"""The run report of a long synthetic run (thousands of steps, warnings, a rollback and a stop): the verdict first, the
guard's events, the health panels in place of the loss curve, bounded tables, and the verdict on the terminal."""

import json
import re

import pytest

from slime_search.health.panels import HEALTH_PANELS
from slime_search.report import main, metrics_table, render_report, table_steps

STEPS = 3000
STOP = (
    "step 2999: training reward 0.100 (mean of 5 steps), 0.500 below its best 0.600 (--health-reward-drop 0.3); "
    "no rollback left (--max-rollbacks 1)"
)


def step_record(step):
    return {
        "step": step,
        "time/step_s": 1.0,
        "train/loss": 0.0,
        "train/entropy": 0.5 if step < 2000 else 0.02,
        "train/kl_loss": 0.001,
        "train/kl_old_new": 0.0005,
        "train/logp_shift_pos": 0.01,
        "train/logp_shift_neg": -0.01,
        "train/pg_clipfrac": 0.02,
        "train/pg_clipfrac_high": 0.01,
        "train/pg_clipfrac_low": 0.01,
        "train/pg_clipfrac_dual": 0.0,
        "train/tis_clipfrac": 0.03,
        "train/tis_weight_mean": 0.99,
        "train/grad_norm": 1.0 if step != 1500 else 90.0,
        "train/grad_norm_max": 1.0 if step != 1500 else 90.0,
        "train/steps": 1.0,
        "train/steps_applied": 0.0 if step == 1500 else 1.0,
        "health/logprob_gap": 0.02,
        "health/logprob_gap_lag0": 0.01,
        "health/logprob_gap_lag1": 0.03,
        "health/is_weight_mean": 1.0,
        "health/is_capped_share": 0.01,
        "health/step_skipped": 0.0,
        "health/warns": 1.0 if 100 <= step < 250 else 0.0,
        "health/rollbacks": 0.0 if step < 250 else 1.0,
        "rollout/reward_mean": 0.6 if step < 2900 else 0.1,
        "rollout/reward_std": 0.2,
        "rollout/response_length_p50": 120.0,
        "rollout/response_length_p90": 200.0,
        "rollout/response_length_max": 400.0,
        "rollout/truncation_rate": 0.6 if 100 <= step < 250 else 0.1,
        "rollout/search_rate": 0.8,
        "rollout/reward_format_valid": 0.95,
        "rollout/invalid_action_rate": 0.01,
        "rollout/zero_std_group_share": 0.3,
    }


def guard_events():
    warnings = [
        {
            "step": step,
            "action": "warn",
            "rule": "truncation",
            "message": f"step {step}: 0.600 of samples truncated (> 0.5)",
            "values": {"value": 0.6},
            "attempt": 0,
        }
        for step in range(100, 250)
    ]
    decision = {
        "step": 250,
        "action": "rollback",
        "rule": "truncation",
        "message": "step 250: truncation held 3 steps in a row",
        "values": {"since": 248.0},
        "attempt": 0,
    }
    back = {
        **decision,
        "message": "back to the checkpoint of step 200 (truncation at step 250); lr x0.5, --async-mode off",
        "values": {"to_step": 200.0, "lr_scale": 0.5, "max_staleness": 0.0},
    }
    stop = {"step": 2999, "action": "stop", "rule": "reward_drop", "message": STOP, "values": {}, "attempt": 1}
    return [*warnings, decision, back, stop]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("long_run")
    records = []
    for step in range(STEPS):
        records.append(step_record(step))
        if step % 250 == 0:
            records.append({"step": step, "eval/em": 0.3, "eval/score": 0.3, "eval/search_rate": 0.7, "time/eval_s": 2})
    write_jsonl(run / "metrics.jsonl", records)
    write_jsonl(run / "health.jsonl", guard_events())
    config = {
        "enabled": True,
        "window": 10,
        "grad_spike": 10.0,
        "entropy_low": 0.1,
        "entropy_high": 3.0,
        "max_logprob_gap": 0.1,
        "max_is_capped_share": 0.2,
        "length_blowup": 2.5,
        "truncation_rise": 0.3,
    }
    (run / "health_config.json").write_text(json.dumps(config))
    page = render_report(run)
    return run, page.read_text()


def section(page, start, end):
    return page[page.index(start) : page.index(end)]


def test_the_page_opens_with_the_verdict_and_the_guards_events(long_run):
    run, page = long_run
    title_end = page.index("</h1>") + len("</h1>")
    assert page[title_end:].startswith(f'<p class="verdict stopped">Health: stopped at step 2999: {STOP}</p>')
    events = section(page, "<h2>Health events (153)</h2>", "<h2>Health signals")
    assert "back to the checkpoint of step 200 (truncation at step 250)" in events
    assert '<tr class="stop"><td>2999</td><td>stop</td><td>reward_drop</td>' in events
    assert "… 53 events omitted …" in events  # 153 events: the first 50 and the last 50 (they end with the rollback)
    assert events.count("<tr class=") == 100


def test_the_health_panels_replace_the_loss_curve(long_run):
    run, page = long_run
    out = run / "report"
    for panel in HEALTH_PANELS:
        assert (out / panel.file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", panel.file
        assert f'<img src="{panel.file}"' in page
    for name in ("reward.png", "em.png", "search_rate.png"):
        assert (out / name).is_file() and f'<img src="{name}"' in page
    assert not (out / "loss.png").exists() and "loss.png" not in page


def test_the_per_step_table_of_a_long_run_is_bounded_and_keeps_the_steps_that_matter(long_run):
    run, page = long_run
    table = section(page, "<h2>Per-step metrics</h2>", "<h2>Rollouts")
    steps = [int(s) for s in re.findall(r"<tr><td>(\d+)</td>", table)]
    assert len(steps) <= 200 and steps == sorted(set(steps))
    assert {0, 250, 2999} <= set(steps)  # the first, the rollback, the stop (the last)
    assert f"{len(steps)} of {STEPS} steps listed" in table and f"{STEPS - len(steps)} omitted" in table
    assert "<th>train/loss</th>" in table and "<th>eval/em</th>" in table
    row_250 = re.search(r"<tr><td>250</td>.*?</tr>", table).group(0)
    assert "0.3" in row_250  # the eval of version 250 sits in the row of step 250


def test_table_steps_take_rollbacks_stops_and_the_last_step_then_events_then_evenly_spaced_ones():
    events = [{"step": s, "action": "warn"} for s in range(1000, 4000)]
    events += [{"step": 4321, "action": "rollback"}, {"step": 4400, "action": "stop"}]
    shown = table_steps(list(range(5000)), events, limit=200)
    assert len(shown) <= 200 and {0, 4321, 4400, 4999} <= set(shown)
    assert 40 <= sum(1000 <= s < 4000 for s in shown) <= 50 + 120  # event steps are at most a quarter, plus spaced
    assert table_steps(list(range(10)), [], limit=200) == list(range(10))


def test_a_short_table_lists_every_step_without_a_note():
    records = [{"step": s, "train/loss": 0.1} for s in range(5)]
    table = metrics_table(records, [])
    assert table.count("<tr><td>") == 5 and "omitted" not in table


def test_the_command_prints_the_verdict_and_the_page(long_run, capsys):
    run, _ = long_run
    assert main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"health: stopped at step 2999: {STOP}", str(run / "report" / "index.html")]
    assert main([str(run / "missing")]) == 2


def test_a_run_without_events_or_guard_settings_is_healthy(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", [step_record(s) for s in range(5)])
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "health: healthy"
    page = (tmp_path / "report" / "index.html").read_text()
    assert '<p class="verdict healthy">Health: healthy</p>' in page and "Health events" not in page
    assert (tmp_path / "report" / "health_entropy.png").is_file()


def test_the_web_search_cost_of_the_run_is_summed_over_training_and_evaluation():
    from slime_search.report import search_cost_section

    records = [
        {
            "step": 0,
            "rollout/search_billed_calls": 120.0,
            "rollout/search_cost_usd": 0.12,
            "rollout/search_cache_hits": 8.0,
        },
        {
            "step": 1,
            "rollout/search_billed_calls": 30.0,
            "rollout/search_cost_usd": 0.03,
            "rollout/search_cache_hits": 90.0,
        },
        {"step": 1, "eval/search_billed_calls": 50.0, "eval/search_cost_usd": 0.05, "eval/search_cache_hits": 2.0},
    ]
    section = search_cost_section(records)
    assert (
        "as the step records kept sum it: 200 billed calls, $0.200" in section
        and "100 answers from the cache" in section
    )
    assert "steps a rollback undid are not in it" in section  # without a budget ledger, what the sum leaves out
    assert search_cost_section([{"step": 0, "rollout/searches_mean": 1.0}]) == ""  # a run on the local retriever


def eval_records():
    return [
        {"step": 0, "eval/em": 0.2, "eval/em_low": 0.1, "eval/em_high": 0.3, "eval/n": 64.0},
        {"step": 1, "rollout/reward_mean": 0.4},
        {
            "step": 2,
            "eval/em": 0.5,
            "eval/em_low": 0.4,
            "eval/em_high": 0.6,
            "eval/n": 164.0,
            "eval/bamboogle/em": 0.25,
            "eval/bamboogle/em_low": 0.1,
            "eval/bamboogle/em_high": 0.4,
            "eval/bamboogle/n": 64.0,
            "eval/nq/em": 0.6,
            "eval/nq/em_low": 0.5,
            "eval/nq/em_high": 0.7,
            "eval/nq/n": 100.0,
            "eval/nq/f1": 0.7,
        },
    ]


def test_the_last_evaluation_is_tabled_per_set_in_the_papers_order_with_its_intervals():
    from slime_search.report import eval_table_section

    section = eval_table_section(eval_records())
    assert "version 2" in section
    header = re.findall(r"<th>(.*?)</th>", section)
    assert header == ["", "NQ", "Bamboogle", "all (pooled)"]
    assert "0.600 [0.500, 0.700]" in section and "0.250 [0.100, 0.400]" in section and "164 questions" in section
    assert eval_table_section([{"step": 0, "rollout/reward_mean": 0.1}]) == ""


def test_the_em_curve_carries_its_interval_band():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from slime_search.report import draw_eval_interval

    fig, ax = plt.subplots()
    draw_eval_interval(ax, eval_records(), None)
    [band] = ax.collections
    assert band.get_label() == "95% interval"
    xs, ys = band.get_paths()[0].vertices.T
    assert {0.0, 2.0} <= set(xs) and {0.1, 0.3, 0.4, 0.6} <= {round(y, 6) for y in ys}
    plt.close(fig)


def test_a_baseline_runs_evaluation_is_drawn_and_tabled_beside_this_one(tmp_path, capsys):
    run, other = tmp_path / "run", tmp_path / "sync"
    run.mkdir()
    other.mkdir()
    write_jsonl(run / "metrics.jsonl", [step_record(s) for s in range(3)] + eval_records())
    baseline = [
        {**r, **{k: v - 0.1 for k, v in r.items() if k.endswith("/em")}} for r in eval_records() if "eval/em" in r
    ]
    write_jsonl(other / "metrics.jsonl", baseline)
    assert main([str(run), "--baseline", str(other)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "<td>baseline (version 2)</td>" in page and "0.500 [0.500, 0.700]" in page  # nq's EM 0.6 - 0.1
    assert "--compare" in page and (run / "report" / "em.png").is_file()
    assert main([str(run), "--baseline", str(tmp_path / "absent")]) == 2
    assert "--baseline" in capsys.readouterr().err


def test_the_report_names_the_weights_the_run_ended_on_and_what_was_set_aside(tmp_path):
    from slime_search.run.folder import RunFolder

    run = RunFolder(tmp_path / "run")
    for step in (0, 5, 10):
        (run.checkpoints / f"iter_{step:07d}").mkdir(parents=True)
    (run.checkpoints / "latest_checkpointed_iteration.txt").write_text("10")
    run.set_aside(5, "stop-at-step-12")
    run.record_final(5, "stopped by the health guard (policy_jump at step 12)", hf=False)
    page = render_report(run.path).read_text()
    assert "The run ended on the weights of step 5, checkpoints/iter_0000005: stopped by the health guard" in page
    assert "Set aside by rollbacks and stops (1): checkpoints/undone/001-stop-at-step-12/iter_0000010." in page
    # a stop before the first save: the weights it ended on have no checkpoint
    early = RunFolder(tmp_path / "early")
    early.record_final(None, "stopped by the health guard (reward_errors at step 0)", hf=False, at_step=0)
    page = render_report(early.path).read_text()
    assert "The run ended on the weights of step 0, never saved: stopped by the health guard (reward_errors" in page
