"""Batch health signals, hand-computed: the trainer-engine log-prob gap and importance weights, by version lag."""

import math

import pytest
import torch

from slime_search.health.signals import batch_signals, importance_signals
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


def mis_sample(old, rollout, mask=None, versions=None):
    n = len(old)
    return TrainSample(
        list(range(1, n + 2)), n, mask or [1] * n, old_log_probs=old, rollout_log_probs=rollout, token_versions=versions
    )


def test_importance_statistics_are_the_whole_steps_and_the_extremes_the_rollouts():
    from slime_search.algo import ISConfig, compute_is_weights

    mis = ISConfig(mode="mask", upper=2.0, batch_normalize=True)
    # weights exp(old - rollout): step 1: 1, e^-1 (below 1/2: masked) | 1, e^0.5, [masked position] ; step 2: e^0.2
    # versions (trainer at 5): lag 0, 2 | lag 1, lag 1, (not a loss token) | lag 0
    first = [
        mis_sample([-1.0, -2.0], [-1.0, -1.0], versions=[5, 3]),
        mis_sample([-1.0, -0.5, -3.0], [-1.0, -1.0, -1.0], [1, 1, 0], versions=[4, 4, 4]),
    ]
    second = [mis_sample([-1.0], [-1.2], versions=[5])]
    out = importance_signals([first, [], second], mis, trainer_version=5)
    # the one token taken out is 2 versions old; the share is the rollout's, over its tokens of that lag
    assert out["train/mis_masked_share_lag2p"] == 1.0
    assert out["train/mis_masked_share_lag0"] == out["train/mis_masked_share_lag1"] == 0.0
    # kept shares 3/4 and 1; ESS over kept weights 1, 1, e^0.5 normalised by their mean
    assert out["train/mis_mask_kept_fraction"] == pytest.approx((3 / 4 + 1) / 2)
    assert out["train/mis_masked_share"] == pytest.approx((1 / 4 + 0) / 2)
    assert out["train/mis_mask_fraction_low"] == pytest.approx((1 / 4 + 0) / 2)
    mean_kept = (2 + math.exp(0.5)) / 3
    assert out["train/mis_batch_norm_factor"] == pytest.approx((mean_kept + math.exp(0.2)) / 2, rel=1e-6)
    # the batch-normalised weights: step 1 from 1 / mean_kept to e^0.5 / mean_kept, step 2 exactly 1
    assert out["train/mis_weight_min"] == pytest.approx(1 / mean_kept, rel=1e-6)
    assert out["train/mis_weight_max"] == pytest.approx(math.exp(0.5) / mean_kept, rel=1e-6)
    assert out["train/mis_weight_mean"] == pytest.approx(1.0, rel=1e-6)  # normalised over what enters the loss
    # the first step's statistics are its whole batch's, computed in one call, not its samples' added
    whole = compute_is_weights(
        torch.tensor([-1.0, -2.0, -1.0, -0.5, -3.0]),
        torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0]),
        torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]),
        [2, 3],
        mis,
    ).metrics
    assert importance_signals([first], mis, 5)["train/mis_ess"] == pytest.approx(float(whole["ess"]))
    with pytest.raises(ValueError, match="log-probs"):
        importance_signals([[TrainSample([1, 2], 1, [1])]], mis, 0)
    assert importance_signals([[], []], mis, 0) == {}  # a rollout that left no sample to train on
