"""A TIS/MIS function written for slime's loss (`--custom-tis-function-path`, e.g. slime's
examples/train_infer_mismatch_helper/mis.compute_mis_weights_with_cp), called on a packed micro-batch as slime's loss
calls it.

slime's loss hands the function per-sample lists: `train_log_probs` (the trainer's log-probs from before the step:
the old ones), `rollout_log_probs` (the engine's), `loss_masks`, with `total_lengths` (prompt + response) and
`response_lengths`, and the flat per-token `pg_loss`; the function returns the weighted `pg_loss`, one (possibly
rejection-masked) mask per sample, and metrics as flat per-token tensors. slime then reduces the loss with the
returned masks and each metric with the masks from before rejection; `TISResult.mask` and the original mask are what
a caller reduces with (slime_search.backends.megatron.loss does).

`CustomTIS` is the loss's configuration of it: the dotted path and the parsed flags the function reads its settings
from (slime hands its TIS function `args`; mis.yaml's keys are set on them by --custom-config-path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CustomTIS:
    """--custom-tis-function-path, as the loss takes it to the Megatron ranks.

    A Ray actor's arguments are pickled. So the function travels by its path and is loaded in the rank's process, and
    the flags travel as the parsed namespace."""

    path: str  # module.function
    args: Any  # argparse.Namespace: what the function receives as `args`

    def load(self) -> Callable[..., Any]:
        """The function, loaded as every plugin is: where slime is not installed, the slime modules it imports
        (slime.backends.megatron_utils.cp_utils) come from slime_search.compat in this process too."""
        from slime_search.plugins import load_function

        return load_function(self.path)


@dataclass(frozen=True)
class TISResult:
    pg_loss: torch.Tensor  # flat, per response token of the micro-batch
    mask: torch.Tensor  # flat: the loss mask after the function's rejection (float)
    metrics: dict[str, torch.Tensor]  # flat per-token, detached, pg_loss's dtype: reduce with the mask before rejection


def call_tis_function(
    function: Callable[..., Any],
    args: Any,
    *,
    pg_loss: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    response_lengths: list[int],
    total_lengths: list[int],
) -> TISResult:
    """`function(args, pg_loss=..., train_log_probs=[...], rollout_log_probs=[...], loss_masks=[...],
    total_lengths=[...], response_lengths=[...])` on flat tensors of the micro-batch's response tokens (sample after
    sample, `response_lengths` of them); its answer checked and flattened. ValueError naming the function when what
    it returns does not fit the micro-batch."""
    lengths = [int(n) for n in response_lengths]
    if len(total_lengths) != len(lengths) or any(t < n for t, n in zip(total_lengths, lengths, strict=True)):
        raise ValueError(f"total_lengths {list(total_lengths)} do not fit response_lengths {lengths}")
    for name, tensor in (("pg_loss", pg_loss), ("old", old_log_probs), ("rollout", rollout_log_probs), ("mask", mask)):
        if tensor.shape != (sum(lengths),):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} for {sum(lengths)} response tokens")
    name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
    weighted, masks, metrics = function(
        args=args,
        pg_loss=pg_loss,
        train_log_probs=list(old_log_probs.split(lengths)),
        rollout_log_probs=list(rollout_log_probs.split(lengths)),
        loss_masks=list(mask.split(lengths)),
        total_lengths=[int(t) for t in total_lengths],
        response_lengths=lengths,
    )
    if weighted.shape != pg_loss.shape:
        raise ValueError(f"{name} returned pg_loss of shape {tuple(weighted.shape)}, expected {tuple(pg_loss.shape)}")
    if [int(m.numel()) for m in masks] != lengths:
        raise ValueError(f"{name} returned masks of {[int(m.numel()) for m in masks]} tokens, expected {lengths}")
    for key, value in metrics.items():
        if value.shape != pg_loss.shape:
            raise ValueError(f"{name} returned metric {key!r} of shape {tuple(value.shape)}, expected per token")
    flat_mask = torch.cat([m.reshape(-1) for m in masks]).to(pg_loss.dtype) if masks else mask.to(pg_loss.dtype)
    # slime's helpers return some metrics as int flags (a truncated token: 1): reduced as the loss's dtype
    return TISResult(weighted, flat_mask, {key: value.detach().to(pg_loss.dtype) for key, value in metrics.items()})
