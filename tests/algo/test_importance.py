import math
import zlib

import pytest
import torch

from slime_search.algo import ISConfig, compute_is_weights, is_batch_stats, vanilla_tis_weights

# Two packed sequences of 2 tokens. train - rollout log-ratios: [ln 3, 0 | ln 0.25, ln 0.5]; the last token is
# masked out. Raw token ratios: [3, 1 | 0.25, (0.5)].
ROLLOUT = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=torch.float64)
TRAIN = ROLLOUT + torch.log(torch.tensor([3.0, 1.0, 0.25, 0.5], dtype=torch.float64))
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
LENGTHS = [2, 2]


def weights_for(**config):
    return compute_is_weights(TRAIN, ROLLOUT, MASK, LENGTHS, ISConfig(**config))


def approx(values):
    return torch.tensor(values, dtype=torch.float64)


def test_vanilla_tis():
    # exp(ln 3) = 3 -> truncated to 2 ; exp(ln 0.5) = 0.5 stays
    w = vanilla_tis_weights(torch.log(approx([3.0, 0.5])), torch.zeros(2, dtype=torch.float64), cap=2.0)
    torch.testing.assert_close(w, approx([2.0, 0.5]))


def test_token_truncate():
    # [3, 1, 0.25] truncated at 2 -> [2, 1, 0.25]; masked token -> 0; 1 of 3 valid tokens above the bound
    out = weights_for(level="token", mode="truncate", upper=2.0)
    torch.testing.assert_close(out.weights, approx([2.0, 1.0, 0.25, 0.0]))
    torch.testing.assert_close(out.mask, MASK)
    assert out.metrics["truncate_fraction"].item() == pytest.approx(1 / 3)
    # ESS = (2 + 1 + 0.25)^2 / (3 * (4 + 1 + 0.0625)) = 10.5625 / 15.1875
    assert out.metrics["ess"].item() == pytest.approx(10.5625 / 15.1875)


def test_token_clip():
    # clipped to [0.5, 2]: [2, 1, 0.5]
    out = weights_for(level="token", mode="clip", upper=2.0, lower=0.5)
    torch.testing.assert_close(out.weights, approx([2.0, 1.0, 0.5, 0.0]))
    assert out.metrics["clip_fraction_low"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_fraction_high"].item() == pytest.approx(1 / 3)


def test_token_mask_mode_drops_out_of_range_tokens():
    # lower defaults to 1 / upper = 0.5: only the token with ratio 1 stays in the loss
    out = weights_for(level="token", mode="mask", upper=2.0)
    torch.testing.assert_close(out.mask, approx([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(out.weights, approx([3.0, 1.0, 0.25, 0.0]))
    assert out.metrics["mask_fraction_low"].item() == pytest.approx(1 / 3)


def test_sequence_and_geometric_levels():
    # sequence: seq 0 sum = ln 3 -> 3 -> truncated 2 ; seq 1 (valid tokens only) = ln 0.25 -> 0.25
    out = weights_for(level="sequence", mode="truncate", upper=2.0)
    torch.testing.assert_close(out.weights, approx([2.0, 2.0, 0.25, 0.0]))
    # geometric: seq 0 mean = ln 3 / 2 -> sqrt 3 ; seq 1 = ln 0.25 -> 0.25
    out = weights_for(level="geometric", mode="truncate", upper=2.0)
    torch.testing.assert_close(out.weights, approx([math.sqrt(3), math.sqrt(3), 0.25, 0.0]))


def test_batch_normalisation_token_and_sequence():
    # token: [2, 1, 0.25] has mean 3.25 / 3 -> divide by it
    out = weights_for(level="token", mode="truncate", upper=2.0, batch_normalize=True)
    torch.testing.assert_close(out.weights, approx([2.0, 1.0, 0.25, 0.0]) / (3.25 / 3))
    assert out.metrics["weight_mean"].item() == pytest.approx(1.0)
    # sequence: one weight per sequence, [2, 0.25] -> mean 1.125
    out = weights_for(level="sequence", mode="truncate", upper=2.0, batch_normalize=True)
    torch.testing.assert_close(out.weights, approx([2.0, 2.0, 0.25, 0.0]) / 1.125)


def test_rejection_and_veto():
    # rejection at token level with bounds [0.5, 2]: ratios [3, 1, 0.25] -> only the middle token survives
    out = weights_for(level="token", mode="truncate", upper=2.0, rejection=True)
    torch.testing.assert_close(out.mask, approx([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(out.weights, approx([2.0, 1.0, 0.25, 0.0]))
    # veto at 0.3: token ratio 0.25 < 0.3 vetoes all of sequence 1
    out = weights_for(level="token", mode="truncate", upper=2.0, veto_threshold=0.3)
    torch.testing.assert_close(out.mask, approx([1.0, 1.0, 0.0, 0.0]))
    assert out.metrics["catastrophic_token_fraction"].item() == pytest.approx(1 / 3)
    assert out.metrics["catastrophic_seq_fraction"].item() == pytest.approx(0.5)


def test_mismatch_metrics():
    out = weights_for()
    # kl = mean(rollout - train) over valid tokens = -(ln 3 + 0 + ln 0.25) / 3
    assert out.metrics["kl"].item() == pytest.approx(-(math.log(3) + math.log(0.25)) / 3)
    # chi2_token = mean(rho^2) - 1 = (9 + 1 + 0.0625) / 3 - 1
    assert out.metrics["chi2_token"].item() == pytest.approx((9 + 1 + 0.0625) / 3 - 1)
    # k3 = mean(rho - ln rho - 1)
    k3 = sum(r - math.log(r) - 1 for r in (3.0, 1.0, 0.25)) / 3
    assert out.metrics["k3_kl"].item() == pytest.approx(k3)


def test_global_normalisation_across_micro_batches_equals_whole_batch():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    n = sum(lengths)
    rollout = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    train = rollout + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    mask = (torch.rand(n, generator=gen) > 0.2).double()
    for level in ("token", "sequence"):
        config = ISConfig(level=level, mode="truncate", upper=1.5, batch_normalize=True)
        whole = compute_is_weights(train, rollout, mask, lengths, config)
        unnormalised = ISConfig(level=level, mode="truncate", upper=1.5)
        halves = [(slice(0, 8), lengths[:2]), (slice(8, n), lengths[2:])]
        stats = sum(
            is_batch_stats(
                compute_is_weights(train[s], rollout[s], mask[s], lens, unnormalised).weights, mask[s], lens, level
            )
            for s, lens in halves
        )
        parts = [
            compute_is_weights(train[s], rollout[s], mask[s], lens, config, normalize_with=stats) for s, lens in halves
        ]
        torch.testing.assert_close(torch.cat([p.weights for p in parts]), whole.weights)
        # normalising each micro-batch on its own (what a per-micro-batch implementation does) differs
        local = torch.cat(
            [compute_is_weights(train[s], rollout[s], mask[s], lens, config).weights for s, lens in halves]
        )
        assert not torch.allclose(local, whole.weights)


def naive_is(train, rollout, mask, lengths, cfg):
    """Per-sequence Python loop, written independently of the vectorised code."""
    weights, new_mask, start = [], [], 0
    for length in lengths:
        t, r, m = train[start : start + length], rollout[start : start + length], mask[start : start + length]
        diffs = [a - b for a, b in zip(t.tolist(), r.tolist(), strict=True)]
        valid = [d for d, k in zip(diffs, m.tolist(), strict=True) if k]
        for d, k in zip(diffs, m.tolist(), strict=True):
            if cfg.level == "token":
                lr = d
            elif cfg.level == "sequence":
                lr = sum(valid)
            else:
                lr = sum(valid) / max(len(valid), 1)
            w = math.exp(max(-20, min(20, lr)))
            keep = float(k)
            if cfg.mode == "truncate":
                w = min(w, cfg.upper)
            elif cfg.mode == "clip":
                w = min(max(w, cfg.is_lower), cfg.upper)
            elif not (cfg.is_lower <= w <= cfg.upper):
                keep = 0.0
            weights.append(w * k)
            new_mask.append(keep)
        start += length
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(new_mask, dtype=torch.float64)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
def test_vectorised_matches_naive_loop(level, mode):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{level}-{mode}".encode()))
    lengths = [int(x) for x in torch.randint(1, 9, (7,), generator=gen)]
    n = sum(lengths)
    rollout = -torch.rand(n, generator=gen, dtype=torch.float64) * 2
    train = rollout + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3
    mask = (torch.rand(n, generator=gen) > 0.25).double()
    cfg = ISConfig(level=level, mode=mode, upper=1.3, lower=0.8)
    out = compute_is_weights(train, rollout, mask, lengths, cfg)
    weights, new_mask = naive_is(train, rollout, mask, lengths, cfg)
    torch.testing.assert_close(out.weights, weights)
    torch.testing.assert_close(out.mask, new_mask)


def test_config_validation():
    with pytest.raises(ValueError, match="valid: token, sequence, geometric"):
        ISConfig(level="batch")
    with pytest.raises(ValueError, match="valid: truncate, clip, mask"):
        ISConfig(mode="cut")
    with pytest.raises(ValueError, match="must be below upper"):
        ISConfig(upper=2.0, lower=3.0)


def test_weight_extremes_are_over_the_kept_tokens_and_zero_when_none_is_kept():
    # truncated weights [2, 1, 0.25, (masked 0)]: the masked token's 0 is not the minimum
    out = weights_for(level="token", mode="truncate", upper=2.0)
    assert (out.metrics["weight_min"].item(), out.metrics["weight_max"].item()) == (0.25, 2.0)
    none_kept = compute_is_weights(TRAIN, ROLLOUT, torch.zeros_like(MASK), LENGTHS, ISConfig())
    assert (none_kept.metrics["weight_min"].item(), none_kept.metrics["weight_max"].item()) == (0.0, 0.0)


def test_every_weight_and_metric_stays_on_the_log_probs_device():
    """The meta device refuses host round trips and CPU operands as a GPU would refuse the latter."""
    meta = [t.to("meta") for t in (TRAIN, ROLLOUT, MASK)]
    config = ISConfig(level="sequence", mode="mask", rejection=True, veto_threshold=1e-4, batch_normalize=True)
    out = compute_is_weights(*meta, LENGTHS, config)
    tensors = [out.weights, out.mask, *out.metrics.values()]
    assert {t.device.type for t in tensors} == {"meta"}
    assert {"batch_norm_factor", "catastrophic_seq_fraction", "weight_min"} <= set(out.metrics)
