"""Batch health signals, hand-computed: the trainer-engine log-prob gap and importance weights, by version lag."""

import math

import pytest

from slime_search.health.signals import batch_signals
from slime_search.types import TrainSample


def test_gap_and_importance_weights_by_version_lag():
    # trainer at version 5. Sample 1: two generated tokens of version 5 (lag 0), an observation, one of version 4
    # (lag 1). Sample 2: two tokens of version 2 (lag 3 -> "2+").
    one = TrainSample(
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=4,
        loss_mask=[1, 1, 0, 1],
        old_log_probs=[-1.0, -2.0, -0.5, -1.0],
        rollout_log_probs=[-1.0, -2.1, 0.0, -2.0],
        token_versions=[5, 5, -1, 4],
    )
    two = TrainSample(
        tokens=[7, 8, 9],
        response_length=2,
        loss_mask=[1, 1],
        old_log_probs=[-0.2, -3.0],
        rollout_log_probs=[-1.2, -2.0],
        token_versions=[2, 2],
    )
    out = batch_signals([one, two], trainer_version=5, is_cap=2.0)
    # diffs old - rollout on loss tokens: 0, 0.1 (lag 0); 1.0 (lag 1); 1.0, -1.0 (lag 2+)
    assert out["health/logprob_gap_lag0"] == pytest.approx(0.05)
    assert out["health/logprob_gap_lag1"] == pytest.approx(1.0)
    assert out["health/logprob_gap_lag2p"] == pytest.approx(1.0)
    assert out["health/logprob_gap"] == pytest.approx(3.1 / 5)
    # weights e^0, e^0.1, e^1, e^1, e^-1: beyond the cap 2 (log 0.693) are the two e^1
    assert out["health/is_capped_share"] == pytest.approx(2 / 5)
    assert out["health/is_capped_share_lag1"] == 1.0 and out["health/is_capped_share_lag0"] == 0.0
    assert out["health/is_weight_max"] == pytest.approx(math.e)
    assert out["health/is_weight_mean"] == pytest.approx((1 + math.exp(0.1) + 2 * math.e + math.exp(-1)) / 5)
    assert out["health/tokens_lag2p"] == 2.0 and out["health/nonfinite_old_log_probs"] == 0.0


def test_non_finite_trainer_log_probs_are_counted_not_averaged():
    sample = TrainSample([1, 2, 3], 2, [1, 1], old_log_probs=[math.nan, -1.0], rollout_log_probs=[-1.0, -1.0])
    out = batch_signals([sample], trainer_version=0, is_cap=2.0)
    assert out["health/nonfinite_old_log_probs"] == 1.0 and out["health/logprob_gap"] == 0.0
    assert batch_signals([TrainSample([1, 2], 1, [1])], 0, 2.0) == {"health/nonfinite_old_log_probs": 0.0}
