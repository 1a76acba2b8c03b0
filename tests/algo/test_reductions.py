import pytest
import torch

from slime_search.algo import REDUCTIONS, masked_mean, reduce_loss, segment_ids, sequence_mean, token_mean

# Two packed sequences of lengths 3 and 2; the third and fifth tokens are masked out.
X = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
LENGTHS = [3, 2]


def test_token_mean_hand_computed():
    # (1 + 2 + 4) / 3 valid tokens = 7/3
    assert token_mean(X, MASK).item() == pytest.approx(7 / 3)
    assert masked_mean(X, MASK).item() == pytest.approx(7 / 3)
    # with a global token count of 7 (the rest of the step lives in other micro-batches): 7 / 7
    assert token_mean(X, MASK, num_tokens=7).item() == pytest.approx(1.0)


def test_sequence_mean_hand_computed():
    # seq 0: (1 + 2) / 2 = 1.5 ; seq 1: 4 / 1 = 4 ; mean over 2 sequences = 2.75
    assert sequence_mean(X, MASK, LENGTHS).item() == pytest.approx(2.75)
    # global denominator of 5 sequences: (1.5 + 4) / 5 = 1.1
    assert sequence_mean(X, MASK, LENGTHS, num_sequences=5).item() == pytest.approx(1.1)


def test_fully_masked_sequence_contributes_zero():
    # seq 1 has no valid token: (1.5 + 0) / 2
    assert sequence_mean(X, torch.tensor([1.0, 1, 0, 0, 0]), LENGTHS).item() == pytest.approx(0.75)
    assert token_mean(X, torch.zeros(5)).item() == 0.0


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 1, 6, 3, 5, 2]
    x = torch.randn(sum(lengths), generator=gen)
    mask = (torch.rand(sum(lengths), generator=gen) > 0.3).float()
    full = reduce_loss(x, mask, lengths, mode)
    kwargs = {"num_tokens": mask.sum().item(), "num_sequences": len(lengths)}
    split = sum(lengths[:3])
    parts = reduce_loss(x[:split], mask[:split], lengths[:3], mode, **kwargs) + reduce_loss(
        x[split:], mask[split:], lengths[3:], mode, **kwargs
    )
    torch.testing.assert_close(parts, full)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="valid: token_mean, sequence_mean"):
        reduce_loss(X, MASK, LENGTHS, "sum")
    with pytest.raises(ValueError, match="lengths sum to 4 but 5 tokens"):
        sequence_mean(X, MASK, [2, 2])
    with pytest.raises(ValueError, match="differ in shape"):
        token_mean(X, MASK[:3])
    assert segment_ids([2, 0, 3]).tolist() == [0, 0, 2, 2, 2]
