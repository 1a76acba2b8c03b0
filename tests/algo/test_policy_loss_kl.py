import math

import pytest
import torch

from slime_search.algo import KL_ESTIMATORS, entropy_from_logits, kl_estimate, policy_loss, token_mean


def _log(values):
    return torch.log(torch.tensor(values, dtype=torch.float64))


def test_policy_loss_hand_computed():
    # ratios r and advantages A, eps_clip 0.2 (low) and 0.28 (high):
    # t0: r=1.5, A=+1: max(-1.5, -1.28) = -1.28          clipped
    # t1: r=0.5, A=+1: max(-0.5, -0.8)  = -0.5           not clipped
    # t2: r=0.5, A=-1: max(0.5, 0.8)    = 0.8            clipped
    # t3: r=4.0, A=-1: max(4.0, 1.28)   = 4.0            not clipped
    # t4: r=1.1, A=+2: max(-2.2, -2.2)  = -2.2           not clipped (inside the range)
    ratios = [1.5, 0.5, 0.5, 4.0, 1.1]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    old = torch.zeros(5, dtype=torch.float64)
    out = policy_loss(_log(ratios), old, adv, eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor([-1.28, -0.5, 0.8, 4.0, -2.2], dtype=torch.float64))
    torch.testing.assert_close(out.clipped, torch.tensor([1.0, 0, 1, 0, 0], dtype=torch.float64))
    assert out.dual_clipped.sum() == 0


def test_dual_clip_bounds_negative_advantages_only():
    # t3 above: A=-1, r=4 -> loss 4.0, dual-clip c=3 bounds it at -A*c = 3.0.
    # t0: A=+1 is never dual-clipped.
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    out = policy_loss(_log([5.0, 4.0, 2.0]), torch.zeros(3, dtype=torch.float64), adv, 0.2, 0.28, eps_clip_c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([-1.28, 3.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(out.dual_clipped, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="must be > 1.0"):
        policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), 0.2, eps_clip_c=0.9)


def test_symmetric_clip_by_default_and_shape_check():
    out = policy_loss(_log([1.5]), torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), 0.2)
    torch.testing.assert_close(out.loss, torch.tensor([-1.2], dtype=torch.float64))
    with pytest.raises(ValueError, match="shapes differ"):
        policy_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), 0.2)


def test_gradient_flows_only_where_mask_is_one():
    gen = torch.Generator().manual_seed(0)
    log_probs = (torch.randn(12, generator=gen) * 0.1 - 1).requires_grad_()
    old = log_probs.detach() + torch.randn(12, generator=gen) * 0.05
    adv = torch.randn(12, generator=gen)
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.float32)
    loss = token_mean(policy_loss(log_probs, old, adv, 0.2, 0.28).loss, mask)
    loss.backward()
    assert torch.all(log_probs.grad[mask == 0] == 0)
    # Every unmasked token that is not clipped must carry gradient.
    unclipped = policy_loss(log_probs.detach(), old, adv, 0.2, 0.28).clipped == 0
    assert torch.all(log_probs.grad[(mask == 1) & unclipped] != 0)


def test_kl_estimators_hand_computed():
    # p = 0.5, p_ref = 0.25: log_ratio = ln 2 = 0.693147
    # k1 = 0.693147 ; k2 = 0.693147^2 / 2 = 0.240227 ; k3 = e^-ln2 - 1 + ln2 = 0.5 - 1 + 0.693147 = 0.193147
    lp, ref = _log([0.5]), _log([0.25])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_estimate(lp, ref, "low_var_kl").item() == pytest.approx(0.193147, abs=1e-6)


def test_low_var_kl_is_clamped_and_non_negative():
    # logp = 0, logp_ref = -30: k3 = e^-30 - 1 + 30 ~ 29 -> clamped to 10
    assert kl_estimate(torch.zeros(1), torch.full((1,), -30.0), "low_var_kl").item() == 10.0
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    assert torch.all(kl_estimate(a, b, "k3") >= 0)
    with pytest.raises(ValueError, match="valid: " + ", ".join(KL_ESTIMATORS)):
        kl_estimate(a, b, "k4")


def test_entropy_from_logits():
    # uniform over 2: ln 2 ; p = [0.25, 0.75] (logits 0, ln 3): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0), 0.562335]), atol=1e-6, rtol=0)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 7, 50, generator=gen)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy_from_logits(z), -(p * torch.log(p)).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_gradient_is_finite_at_an_extreme_masked_token(kind):
    # The reference is 94.5 nats above the policy on a masked token: exp(-log_ratio) = e^94.5 overflows float32, and
    # unclamped, the clamp's zero gradient times inf made the gradient of the whole masked sum NaN.
    log_probs = torch.tensor([-95.0, -0.7], requires_grad=True)
    ref = torch.tensor([-0.5, -0.6])
    mask = torch.tensor([0.0, 1.0])
    estimate = kl_estimate(log_probs, ref, kind)
    assert estimate[0].item() == 10.0  # the value is unchanged by the bound: it sits at the clamp either way
    (estimate * mask).sum().backward()
    assert torch.isfinite(log_probs.grad).all()
    assert log_probs.grad[0] == 0 and log_probs.grad[1] != 0


def test_policy_ratio_is_bounded_so_an_extreme_masked_token_cannot_poison_the_step():
    # logp - logp_old = +95 on a masked token: exp overflows to inf and inf * 0 is NaN; with the log-ratio clamped at
    # +-20 the loss and gradient stay finite and the masked token contributes nothing.
    log_probs = torch.tensor([-0.5, -1.0], requires_grad=True)
    old = torch.tensor([-95.5, -1.1])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([0.0, 1.0])
    out = policy_loss(log_probs, old, adv, 0.2, 0.28)
    assert out.ratio[0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    loss = token_mean(out.loss, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    assert log_probs.grad[0] == 0
    # inside the bound nothing changed: token 1 (ratio e^0.1 = 1.105, A = +1, not clipped) has d/dlogp = -ratio / 1
    assert log_probs.grad[1].item() == pytest.approx(-math.exp(0.1), rel=1e-6)


def test_likelihood_preservation_acts_only_on_responses_whose_likelihood_fell():
    from slime_search.algo import likelihood_preservation

    # response 1 (3 tokens, the middle one masked): logp - old = +0.2, (-5 masked), -0.5 -> masked sum -0.3 < 0: it
    # fell; its token 3 fell by 0.5 (penalised), token 1 rose (0), the masked token is left to the mask.
    # response 2 (2 tokens): +0.4, -0.1 -> sum +0.3: its likelihood held, no penalty although token 2 fell.
    old = torch.tensor([-1.0, -1.0, -1.0, -2.0, -2.0])
    new = torch.tensor([-0.8, -6.0, -1.5, -1.6, -2.1], requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    penalty = likelihood_preservation(new, old, mask, [3, 2])
    torch.testing.assert_close(penalty.detach(), torch.tensor([0.0, 5.0, 0.5, 0.0, 0.0]))
    token_mean(penalty, mask).backward()
    # d/dlogp of max(0, old - logp) / 4 tokens = -1/4 on the penalised unmasked token, 0 elsewhere
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 0.0, -0.25, 0.0, 0.0]))
    # at the old policy itself (the first step of a rollout) there is nothing to preserve
    assert likelihood_preservation(old, old, mask, [3, 2]).abs().sum() == 0
