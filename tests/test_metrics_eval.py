import pytest

from slime_search.evaluation import evaluate_samples
from slime_search.metrics import MetricsSink, percentile
from slime_search.types import Sample, Status


def sample(source, response, golds, searches=0, status=Status.COMPLETED):
    s = Sample(response=response, label={"ground_truth": {"target": golds}}, status=status)
    s.metadata["data_source"] = source
    s.metrics.update(searches=searches, turns=searches + 1)
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


def test_metrics_sink_writes_jsonl(tmp_path):
    sink = MetricsSink(tmp_path)
    sink.log(0, {"rollout/reward_mean": 0.5, "train/loss": 1.25})
    sink.log(1, {"rollout/reward_mean": 0.75})
    assert [r["step"] for r in sink.read()] == [0, 1]
    assert sink.read()[0]["train/loss"] == 1.25
    assert percentile([5, 1, 3, 2, 4], 0.5) == 3 and percentile([1, 2, 3, 4], 0.99) == 4
