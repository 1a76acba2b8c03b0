"""slime's TIS/MIS helper (examples/train_infer_mismatch_helper/mis.py at slime 624b824, read from ../shared/compat)
imports and runs here, called on a packed micro-batch the way slime's loss calls it (custom_tis.call_tis_function),
with the settings of slime's mis.yaml."""

from __future__ import annotations

import importlib.util
import math
from argparse import Namespace

import pytest
import torch
import yaml

from slime_search.backends.megatron.custom_tis import call_tis_function
from tests.compat.conftest import MIS


@pytest.fixture
def mis(slime_files, slime_api):
    spec = importlib.util.spec_from_file_location("slime_mis_helper", MIS / "mis.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mis_yaml_args(**overrides) -> Namespace:
    """The flags slime's --custom-config-path mis.yaml sets."""
    return Namespace(**{**yaml.safe_load((MIS / "mis.yaml").read_text()), **overrides})


def packed(ratios: list[float], masks: list[int], lengths: list[int]):
    """Old log-probs log(ratio) against rollout log-probs 0: the importance ratios are `ratios`."""
    old = torch.tensor([math.log(r) for r in ratios])
    return dict(
        pg_loss=torch.ones(len(ratios)),
        old_log_probs=old,
        rollout_log_probs=torch.zeros(len(ratios)),
        mask=torch.tensor(masks, dtype=torch.float32),
        response_lengths=lengths,
        total_lengths=[n + 4 for n in lengths],
    )


def test_mis_weights_and_rejection_with_slimes_settings(mis):
    """mis.yaml: token-level TIS truncated at 2, token-level rejection outside [0.5, 2], batch normalisation.

    Ratios A = [1.5, 3.0], B = [0.4, 1.0, 1.0] with B's middle token masked out:
      truncated weights   A = [1.5, 2.0]          B = [0.4, 0.0, 1.0]   (masked tokens weigh 0)
      rejection masks     A = [1, 0] (3.0 > 2)    B = [0, 0, 1]         (0.4 < 0.5)
      normalisation       mean over the 4 unmasked tokens = (1.5 + 2.0 + 0.4 + 1.0) / 4 = 1.225
    """
    args = mis_yaml_args()
    assert (args.tis_mode, args.tis_upper_bound, args.use_rs, args.tis_batch_normalize) == ("truncate", 2.0, True, True)
    result = call_tis_function(
        mis.compute_mis_weights_with_cp, args, **packed([1.5, 3.0, 0.4, 1.0, 1.0], [1, 1, 1, 0, 1], [2, 3])
    )
    expected = torch.tensor([1.5, 2.0, 0.4, 0.0, 1.0]) / 1.225
    torch.testing.assert_close(result.pg_loss, expected)
    assert result.mask.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.metrics["mis_tis_truncate_fraction"].tolist() == [0, 1, 0, 0, 0]
    assert result.metrics["mis_rs_mask_fraction_low"].tolist() == [0, 0, 1, 0, 0]
    torch.testing.assert_close(result.metrics["mis_batch_norm_factor"], torch.full((5,), 1.225))
    assert all(value.shape == (5,) for value in result.metrics.values())


def test_without_tis_the_loss_is_unchanged_and_only_mismatch_metrics_come_back(mis):
    batch = packed([1.5, 3.0, 0.4], [1, 1, 1], [1, 2])
    result = call_tis_function(mis.compute_mis_weights_with_cp, mis_yaml_args(use_tis=False), **batch)
    assert torch.equal(result.pg_loss, batch["pg_loss"]) and result.mask.tolist() == [1.0, 1.0, 1.0]
    # the engine-vs-trainer KL per token: rollout - train = -log(ratio)
    torch.testing.assert_close(result.metrics["mis_kl"], -batch["old_log_probs"])


def test_a_function_whose_answer_does_not_fit_the_micro_batch_is_named(mis):
    def short_masks(args, *, pg_loss, loss_masks, **kwargs):
        return pg_loss, loss_masks[:1], {}

    with pytest.raises(ValueError, match=r"short_masks returned masks of \[1\] tokens, expected \[1, 2\]"):
        call_tis_function(short_masks, mis_yaml_args(), **packed([1.0, 1.0, 1.0], [1, 1, 1], [1, 2]))
    with pytest.raises(ValueError, match="old has shape"):
        call_tis_function(short_masks, None, **{**packed([1.0, 1.0], [1, 1], [1, 1]), "old_log_probs": torch.zeros(3)})
