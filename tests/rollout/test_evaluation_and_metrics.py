"""Evaluation metrics from the reward's numeric keys, the rollout's search metrics, and the metrics sink."""

import asyncio

import pytest

from slime_search.metrics import MetricsSink, percentile
from slime_search.rollout.eval_metrics import evaluate_samples
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.reward import reward_func
from slime_search.types import Sample, Status


def sample(source, response, golds, searches=0, status=Status.COMPLETED):
    """A sample scored as the rollout scores it: the reward plugin runs on trainable samples only."""
    s = Sample(response=response, label={"ground_truth": {"target": golds}}, status=status)
    s.metadata["data_source"] = source
    s.metrics.update(searches=searches, turns=searches + 1)
    if s.trainable:
        s.reward = asyncio.run(reward_func(search_r1_args(), s))
    return s


def test_em_subem_f1_and_search_rate_per_data_source():
    samples = [
        sample("nq", "<answer> Paris </answer>", ["Paris"], searches=1),
        sample("nq", "<answer> Paris, France </answer>", ["Paris"]),
        sample("hotpotqa", "<answer> yes </answer>", ["no"], searches=2),
        sample("hotpotqa", "<answer> Lyon </answer>", ["Lyon"], status=Status.FAILED),  # failed counts as wrong
    ]
    metrics = evaluate_samples(samples)
    # nq: EM 1/2; sub-EM 2/2; F1 (1 + 2/3) / 2
    assert metrics["eval/nq/em"] == 0.5 and metrics["eval/nq/subem"] == 1.0
    assert metrics["eval/nq/f1"] == pytest.approx((1 + 2 / 3) / 2)
    assert metrics["eval/hotpotqa/em"] == 0.0 and metrics["eval/hotpotqa/search_rate"] == 0.5
    assert metrics["eval/em"] == 0.25 and metrics["eval/n"] == 4.0
    assert metrics["eval/turns"] == pytest.approx((2 + 1 + 3 + 1) / 4)
    assert metrics["eval/nq/format_valid"] == 0.0  # no <think> block: Search-R1's format check fails
    # EM and the reward key carry their 95% interval; other keys do not
    assert metrics["eval/nq/em_low"] <= 0.5 <= metrics["eval/nq/em_high"]
    assert metrics["eval/em_low"] <= 0.25 <= metrics["eval/em_high"] and metrics["eval/em_high"] < 1.0
    assert "eval/score_low" in metrics and "eval/f1_low" not in metrics and "eval/hotpotqa/f1_high" not in metrics
    assert metrics["eval/hotpotqa/em_low"] == metrics["eval/hotpotqa/em_high"] == 0.0


def test_any_numeric_reward_key_is_averaged_and_a_plain_float_is_named_by_the_reward_key():
    scored = Sample(reward={"score": 1.0, "bleu": 0.5, "correct": True, "answer": "x"}, status=Status.COMPLETED)
    half = Sample(reward={"score": 0.0, "bleu": 0.25, "correct": False, "answer": None}, status=Status.COMPLETED)
    failed = Sample(status=Status.FAILED)  # never scored: 0 on every key
    metrics = evaluate_samples([scored, half, failed])
    assert metrics["eval/score"] == pytest.approx(1 / 3) and metrics["eval/bleu"] == pytest.approx(0.25)
    assert metrics["eval/correct"] == pytest.approx(1 / 3) and "eval/answer" not in metrics
    plain = evaluate_samples([Sample(reward=0.5, status=Status.COMPLETED)], reward_key="accuracy")
    assert plain["eval/accuracy"] == 0.5 and plain["eval/n"] == 1.0


def test_metrics_sink_writes_jsonl(tmp_path):
    sink = MetricsSink(tmp_path)
    sink.log(0, {"rollout/reward_mean": 0.5, "train/loss": 1.25})
    sink.log(1, {"rollout/reward_mean": 0.75})
    assert [r["step"] for r in sink.read()] == [0, 1]
    assert sink.read()[0]["train/loss"] == 1.25
    assert percentile([5, 1, 3, 2, 4], 0.5) == 3 and percentile([1, 2, 3, 4], 0.99) == 4


def test_resumed_run_forgets_records_of_redone_steps(tmp_path):
    sink = MetricsSink(tmp_path)
    for step in range(4):
        sink.log(step, {"train/loss": float(step)})
    sink.drop_from(2)
    sink.log(2, {"train/loss": 9.0})
    assert [(r["step"], r["train/loss"]) for r in MetricsSink(tmp_path).read()] == [(0, 0.0), (1, 1.0), (2, 9.0)]


def test_phase_clock_splits_a_step_into_consecutive_phases(monkeypatch):
    from slime_search import metrics

    ticks = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(ticks))
    clock = metrics.PhaseClock()
    clock.mark("rollout")
    clock.mark("train")
    clock.mark("sync")
    assert clock.times() == {"time/rollout_s": 2.5, "time/train_s": 7.5, "time/sync_s": 0.25, "time/step_s": 10.25}


def test_rollout_metrics_describe_search_behaviour_and_refuse_mixed_weight_versions():
    from slime_search.rollout.sample_metrics import rollout_metrics

    a, b = Sample(), Sample(metadata={"finish_reason": "search_error"})
    a.metrics.update(turns=3, searches=2, search_latency_s=0.5, invalid_actions=1, obs_truncations=1)
    b.metrics.update(turns=1, searches=0, search_latency_s=0.0)
    a.weight_versions, b.weight_versions = ["4", "4"], ["4"]
    out = rollout_metrics([a, b])
    assert out["rollout/searches_mean"] == 1.0 and out["rollout/search_rate"] == 0.5
    assert out["rollout/invalid_action_rate"] == 0.5 and out["rollout/search_failures"] == 1.0
    assert out["rollout/search_latency_p50_s"] == 0.25 and out["rollout/weight_version"] == 4.0
    b.weight_versions = ["3"]
    with pytest.raises(RuntimeError, match="mixed weight versions"):
        rollout_metrics([a, b])


def test_evaluation_grades_the_subsets_rows_of_each_set(tmp_path):
    """--eval-sample: a fixed draw per set, the same at every evaluation; the set's name fills in data_source."""
    import json

    from slime_search.evaluation.subsets import EvalSubset, fixed_subset
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import evaluation_samples

    path = tmp_path / "nq.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": ["a"]}) + "\n" for i in range(20)))
    seen = []

    def run(source, config, params):
        seen.append(config.batch_size)
        return [[Sample(prompt=row["prompt"], status=Status.COMPLETED)] for row in source.rows], None

    data = DataConfig("", "prompt", "label")
    samples = evaluation_samples((("nq", str(path)),), data, "score", run, {}, EvalSubset(size=5, seed=2))
    assert [s.prompt for s in samples] == [f"q{i}" for i in fixed_subset(20, 5, 2, "nq")] and seen == [5]
    assert {s.metadata["data_source"] for s in samples} == {"nq"}
    assert {s.metadata["eval_set_size"] for s in samples} == {20}  # a subset: its interval is about all 20
    everything = evaluation_samples((("nq", str(path)),), data, "score", run, {})
    assert [s.prompt for s in everything] == [f"q{i}" for i in range(20)]
    assert not any("eval_set_size" in s.metadata for s in everything)


def test_each_evaluated_sample_names_its_question_by_its_data_row_not_its_prompt(tmp_path):
    """Rows 1 and 2 share a prompt: their samples carry their rows in the file, and their graded rows are two
    questions; with Search-R1's extra_info the question is named by its split and index."""
    import json

    from slime_search.evaluation.grading import rows_from_samples
    from slime_search.evaluation.subsets import EvalSubset
    from slime_search.rollout.data_source import DataConfig
    from slime_search.rollout.manager import evaluation_samples

    plain, indexed = tmp_path / "plain.jsonl", tmp_path / "indexed.jsonl"
    plain.write_text("".join(json.dumps({"prompt": p, "label": ["a"]}) + "\n" for p in ("x", "y", "y", "z")))
    indexed.write_text(
        "".join(
            json.dumps({"prompt": p, "label": ["a"], "extra_info": {"split": "test", "index": 10 + i}}) + "\n"
            for i, p in enumerate(("y", "y", "z"))
        )
    )

    def run(source, config, params):
        items = source.take(len(source))
        return [[Sample(prompt=i.prompt, status=Status.COMPLETED, metadata=dict(i.metadata))] for i in items], None

    data = DataConfig("", "prompt", "label")
    samples = evaluation_samples((("plain", str(plain)),), data, "score", run, {}, EvalSubset(size=3, seed=0))
    chosen = [s.metadata["eval_row"] for s in samples]
    assert len(chosen) == 3 and chosen == sorted(chosen) and set(chosen) <= {0, 1, 2, 3}
    assert [s.prompt for s in samples] == [["x", "y", "y", "z"][i] for i in chosen]  # each row where it stands
    ids = [row["id"] for row in rows_from_samples(samples)]
    assert ids == [str(i) for i in chosen]
    samples = evaluation_samples((("indexed", str(indexed)),), data, "score", run, {})
    assert [row["id"] for row in rows_from_samples(samples)] == ["test:10", "test:11", "test:12"]
