import math

import pytest
import torch

from slime_search.algo import expand_to_tokens, grpo_advantages


def naive_grpo(rewards, groups, normalize_std=True, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        if len(members) < 2:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return torch.tensor(out)


def test_hand_computed_unequal_groups():
    # group 7: rewards [1, 0, 0] -> mean 1/3, centred [2/3, -1/3, -1/3],
    #   unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 0.57735 -> [1.1547, -0.57735, -0.57735]
    # group 3: rewards [1, 1] -> zero variance -> 0 / (0 + eps) = 0
    # group 9: a single member has no baseline -> 0
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    groups = torch.tensor([7, 3, 7, 9, 3, 7])
    adv = grpo_advantages(rewards, groups)
    expected = torch.tensor([1.1547, 0.0, -0.57735, 0.0, 0.0, -0.57735])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_dr_grpo_is_mean_centred_only():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    groups = torch.tensor([7, 3, 7, 9, 3, 7])
    adv = grpo_advantages(rewards, groups, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, 0.0, -1 / 3, 0.0, 0.0, -1 / 3]))


def test_dropped_members_use_their_own_group_statistics():
    # Group 0 lost one of its 4 samples: its 3 survivors must be normalised among themselves, and group 1
    # must be unaffected, which a reshape to [n_groups, n] cannot do.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv = grpo_advantages(rewards, groups)
    torch.testing.assert_close(adv[:3], grpo_advantages(rewards[:3], groups[:3]))
    torch.testing.assert_close(adv[3:], grpo_advantages(rewards[3:], groups[3:]))
    assert not torch.allclose(adv[:3], grpo_advantages(rewards[:4], torch.zeros(4))[:3])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_naive_loop_on_random_groups(normalize_std):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        groups = torch.randint(0, 6, (n,), generator=gen)
        rewards = torch.rand(n, generator=gen).round(decimals=1)
        expected = naive_grpo(rewards.tolist(), groups.tolist(), normalize_std).float()
        torch.testing.assert_close(grpo_advantages(rewards, groups, normalize_std=normalize_std), expected)


def test_equal_groups_match_reshape_formula():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(4, 5, generator=gen)
    expected = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    groups = torch.arange(4).repeat_interleave(5)
    torch.testing.assert_close(grpo_advantages(rewards.flatten(), groups), expected.flatten())


def test_shape_errors_and_expansion():
    with pytest.raises(ValueError, match="must be equal 1-D"):
        grpo_advantages(torch.zeros(3), torch.zeros(2))
    assert grpo_advantages(torch.zeros(0), torch.zeros(0)).numel() == 0
    torch.testing.assert_close(expand_to_tokens(torch.tensor([1.0, -2.0]), [2, 3]), torch.tensor([1.0, 1, -2, -2, -2]))
    with pytest.raises(ValueError, match="2 values for 3 sequences"):
        expand_to_tokens(torch.tensor([1.0, 2.0]), [1, 1, 1])


def test_zero_variance_group_with_inexact_rewards_gives_zero():
    # 0.3 is inexact in binary: a float32 mean leaves ~1e-8 residues that (0 + eps) would blow up to ~1e-2.
    adv = grpo_advantages(torch.tensor([0.3, 0.3, 0.3, 0.7, 0.7], dtype=torch.float32), torch.tensor([0, 0, 0, 1, 1]))
    assert adv.abs().max().item() < 1e-6
