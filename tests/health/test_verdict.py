"""The verdict line from hand-written guard events: healthy, warned, rolled back, stopped, and the events listed when
there are too many."""

from slime_search.health.verdict import events_shown, level, shorten, verdict


def event(step, action, rule, message, **values):
    return {"step": step, "action": action, "rule": rule, "message": message, "values": values, "attempt": 0}


WARN = event(4, "warn", "entropy_collapse", "step 4: entropy 0.01 < 0.1 x its start 0.5", value=0.01, start=0.5)
REFUSE = event(5, "refuse", "grad_spike", "step 5: 1 of 1 updates not applied (gradient norm 90.0)", grad_norm=90.0)
SKIP = event(6, "skip", "search_failures", "step 6: 9 of 10 search calls failed", failures=9.0, calls=10.0)
DECIDED = event(7, "rollback", "entropy_collapse", "step 7: entropy_collapse held 3 steps in a row", since=5.0)
BACK = event(
    7,
    "rollback",
    "entropy_collapse",
    "back to the checkpoint of step 4 (entropy_collapse at step 7); lr x0.5, --async-mode off (max staleness 0)",
    to_step=4.0,
    lr_scale=0.5,
    max_staleness=0.0,
)
STOP = event(12, "stop", "reward_drop", "step 12: training reward 0.1; no rollback left (--max-rollbacks 1)")


def test_a_run_without_events_is_healthy():
    assert verdict([]) == "healthy"
    assert level([]) == "healthy"


def test_warnings_name_the_first_step_rule_and_message_and_count_each_kind():
    events = [WARN, event(5, "warn", "truncation", "step 5: 0.6 of samples truncated"), REFUSE, SKIP]
    assert verdict(events) == (
        "warned at step 4: entropy_collapse (2 warnings, 1 refused updates, 1 skipped steps); "
        "first: step 4: entropy 0.01 < 0.1 x its start 0.5"
    )
    assert level(events) == "warned"


def test_a_held_out_fall_the_guard_watched_leaves_a_run_healthy_and_is_named():
    """A first held-out fall is watched (its checkpoint kept, the next evaluations awaited): nothing for the user to do,
    so the run stays healthy, its line names the fall; a run that also warned counts only its warnings."""
    watch = event(10, "watch", "eval_drop", "eval/em 0.797 at version 10, 0.203 below its best 1.000; watching")
    assert level([watch]) == "healthy"
    assert verdict([watch]) == "healthy; watched 1 held-out fall, first: " + watch["message"]
    assert verdict([watch, {**watch, "step": 20}]).startswith("healthy; watched 2 held-out falls, first: eval/em 0.797")
    assert verdict([watch, WARN]).startswith("warned at step 4: entropy_collapse (1 warnings, 0 refused")
    assert level([watch, WARN]) == "warned"


def test_rollbacks_count_the_completed_ones_and_quote_the_last_with_its_checkpoint():
    second = {**BACK, "step": 15, "message": "back to the checkpoint of step 10 (reward_drop at step 15); lr x0.25"}
    second["rule"] = "reward_drop"
    events = [WARN, DECIDED, BACK, event(15, "rollback", "reward_drop", "step 15: reward fell", since=10.0), second]
    assert verdict(events) == (
        "rolled back 2 times; last at step 15: reward_drop: back to the checkpoint of step 10 (reward_drop at step 15); "
        "lr x0.25"
    )
    assert verdict([WARN, DECIDED, BACK]).startswith("rolled back 1 time; last at step 7: entropy_collapse: back to")
    assert level(events) == "rolled_back"


def test_a_rollback_cut_short_before_its_checkpoint_still_counts():
    assert verdict([DECIDED]) == (
        "rolled back 1 time; last at step 7: entropy_collapse: step 7: entropy_collapse held 3 steps in a row"
    )


def test_a_stop_outranks_rollbacks_and_warnings():
    events = [WARN, DECIDED, BACK, REFUSE, STOP]
    assert verdict(events) == "stopped at step 12: step 12: training reward 0.1; no rollback left (--max-rollbacks 1)"
    assert level(events) == "stopped"


def test_the_verdict_stays_one_line_with_long_messages_cut():
    long = event(3, "stop", "reward_errors", "step 3: first error:\n" + "Traceback line\n" * 200)
    line = verdict([long])
    assert "\n" not in line
    assert line.startswith("stopped at step 3: step 3: first error: Traceback line Traceback line")
    assert line.endswith("…") and len(line) == len("stopped at step 3: ") + 300
    assert shorten("a  b\n c") == "a b c"


def test_many_events_keep_the_first_and_last_fifty_and_every_rollback_and_stop():
    warnings = [event(step, "warn", "truncation", f"step {step}") for step in range(300)]
    events = warnings[:150] + [DECIDED, BACK] + warnings[150:] + [STOP]
    rows = events_shown(events)
    listed = [r for r in rows if isinstance(r, dict)]
    assert listed[:50] == events[:50] and listed[-50:] == events[-50:]
    assert DECIDED in listed and BACK in listed and STOP in listed
    assert [r for r in rows if isinstance(r, int)] == [100, 101]  # warnings 50..149, then 150..250
    assert len(listed) + 201 == len(events)
    assert events_shown(events[:80]) == events[:80]


def test_a_stop_the_run_was_resumed_after_no_longer_ends_it():
    from slime_search.health.verdict import verdict

    stop = {"step": 3, "action": "stop", "rule": "reward_errors", "message": "step 3: rewards not usable", "values": {}}
    resume = {"step": 2, "action": "resume", "rule": "resume", "message": "resumed after step 2", "values": {}}
    assert verdict([stop]).startswith("stopped at step 3")
    assert verdict([stop, resume]) == "healthy"
    warn = {"step": 4, "action": "warn", "rule": "logprob_gap", "message": "step 4: gap", "values": {}}
    assert verdict([stop, resume, warn]).startswith("warned at step 4: logprob_gap (1 warnings")
    assert verdict([stop, resume, warn, {**stop, "step": 6}]).startswith("stopped at step 6")


END = event(
    20,
    "end_on_best",
    "late_decline",
    "eval/score 0.859 at the final version 20 (interval up to 0.938) is 0.125 below 0.984 at version 14 "
    "(--health-end-drop 0.1): the run ends on the checkpoint of step 14",
    ended_on=14.0,
)


def test_a_run_that_ended_on_its_best_checkpoint_says_so_after_its_situation():
    assert level([END]) == "healthy"
    assert verdict([END]) == f"healthy; ended on its best checkpoint: {END['message']}"
    assert verdict([WARN, END]).startswith("warned at step 4: entropy_collapse (1 warnings,")
    assert verdict([WARN, END]).endswith("the run ends on the checkpoint of step 14")
    assert END in events_shown([WARN] * 200 + [END] + [WARN] * 200, head=2, tail=2)
