"""The progress of a rollout where stderr is not a terminal: a plain line every so many seconds."""

from slime_search.rollout.progress import ProgressLines


def test_a_progress_line_is_due_every_period_and_says_samples_and_elapsed_time():
    lines = ProgressLines("rollout 3", start=100.0, every_s=30.0)
    assert lines.line(0, 64, now=110.0) is None
    assert lines.line(12, 64, now=130.0) == "rollout 3: 12/64 samples, 30 s"
    assert lines.line(20, 64, now=150.0) is None  # 20 s after the last line
    assert lines.line(40, 64, now=161.0) == "rollout 3: 40/64 samples, 61 s"
