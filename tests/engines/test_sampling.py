import math

import pytest
import torch

from slime_search.engines.sampling import SamplingParams, filter_top_k_top_p, sample_tokens


def test_sampling_params_parse_and_validate():
    params = SamplingParams.from_request({"temperature": 0.7, "stop": "</search>", "stop_token_ids": [5], "n": 1})
    assert params.stop == ("</search>",) and params.stop_token_ids == (5,) and params.extra == {"n": 1}
    for bad, message in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -2}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_request(bad)


def test_top_k_and_top_p_filter_hand_computed():
    # probabilities [0.5, 0.3, 0.15, 0.05] (logits = log p)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_top_k_top_p(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.75, 0.8]))
    kept = torch.isfinite(out)
    # row 0: top-2 -> tokens 0, 1
    # row 1: top-p 0.75: mass before token 1 is 0.5 < 0.75 (kept), before token 2 is 0.8 >= 0.75 (dropped)
    # row 2: top-p 0.8: mass before token 2 is 0.8 >= 0.8 -> dropped
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]
    torch.testing.assert_close(out[kept], logits[kept])


def test_sampled_log_probs_are_of_the_temperature_scaled_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3])
    tokens, log_probs = sample_tokens(logits, temperature, torch.ones(4), torch.full((4,), -1), gen)
    assert tokens[2] == logits[2].argmax()  # greedy row
    for row in range(4):
        t = temperature[row].item() or 1.0
        expected = torch.log_softmax(logits[row] / t, -1)[tokens[row]]
        assert log_probs[row].item() == pytest.approx(expected.item(), abs=1e-6)


def test_sampling_follows_the_distribution_and_respects_top_k():
    gen = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(4000, 3)
    tokens, _ = sample_tokens(logits, torch.ones(4000), torch.ones(4000), torch.full((4000,), -1), gen)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    # binomial standard error at n=4000 is <= 0.008; allow 4 sigma
    assert torch.allclose(freq, probs, atol=0.032)
    tokens, log_probs = sample_tokens(logits, torch.ones(4000), torch.ones(4000), torch.full((4000,), 1), gen)
    assert torch.all(tokens == 0)
    # top-k restricts the draw, not the reported log-prob: still log 0.6 under the full distribution
    assert torch.allclose(log_probs, torch.full((4000,), math.log(0.6)))


def test_a_greedy_batch_draws_nothing_from_the_sampling_stream():
    """An evaluation (greedy) between training rollouts leaves the engine's random stream where it was: the rollouts
    after it sample what they would have sampled without it."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    ones, no_k = torch.ones(3), torch.full((3,), -1)
    untouched, evaluated = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    tokens, log_probs = sample_tokens(logits, torch.zeros(3), ones, no_k, evaluated)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(log_probs, torch.log_softmax(logits, -1).max(-1).values)
    after_eval = sample_tokens(logits, ones, ones, no_k, evaluated)[0]
    assert torch.equal(after_eval, sample_tokens(logits, ones, ones, no_k, untouched)[0])
    assert evaluated.get_state().equal(untouched.get_state())


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    """A request with sampling_seed draws from (seed, position): alone, first or last in a batch, after any number of
    other draws from the shared stream, it samples the same token; another position or seed draws anew."""
    from slime_search.engines.sampling import seeded_uniform

    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens: the drawn token shows the uniform draw
    one, no_k = torch.ones(1), torch.full((1,), -1)
    alone = sample_tokens(logits, one, one, no_k, torch.Generator().manual_seed(0), [(11, 5)])[0]
    crowd = torch.zeros(4, 1000)
    ones, no_ks = torch.ones(4), torch.full((4,), -1)
    for seed in (1, 2):
        first = sample_tokens(
            crowd, ones, ones, no_ks, torch.Generator().manual_seed(seed), [(11, 5), None, None, None]
        )
        last = sample_tokens(crowd, ones, ones, no_ks, torch.Generator().manual_seed(seed), [None, None, None, (11, 5)])
        assert first[0][0] == last[0][3] == alone[0]
    assert alone[0] == int(seeded_uniform(11, 5) * 1000)
    draws = {seeded_uniform(11, p) for p in range(50)} | {seeded_uniform(s, 5) for s in range(50)}
    assert len(draws) == 99  # every other position and seed draws anew


def test_a_sampling_seed_is_an_integer():
    assert SamplingParams.from_request({"sampling_seed": 7}).sampling_seed == 7
    assert SamplingParams.from_request({"sampling_seed": None}).sampling_seed is None  # SGLang: null is the default
    with pytest.raises(TypeError, match="sampling_seed must be an integer"):
        SamplingParams.from_request({"sampling_seed": "7"})


def test_seeded_draws_follow_the_distribution():
    """Seeded rows sample as the shared stream does: one seed per row (as one trajectory each) gives the token
    frequencies of the distribution."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(4000, 3)
    ones, no_k = torch.ones(4000), torch.full((4000,), -1)
    tokens, _ = sample_tokens(
        logits, ones, ones, no_k, torch.Generator().manual_seed(0), [(s, 17) for s in range(4000)]
    )
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.032)  # 4 binomial standard errors at n = 4000
