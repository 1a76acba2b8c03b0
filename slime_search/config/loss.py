"""The loss's configuration, its command-line flags declared as its fields (slime's names; slime's spellings as
aliases). Fields set from several flags or from the run (the KL weight without --use-kl-loss, the reduction, the
importance weights, the sampling temperature, the vocabulary) are derived by `slime_search.run.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slime_search.algo.kl import KL_ESTIMATORS
from slime_search.algo.reductions import REDUCTIONS
from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import non_negative_float, positive_float

if TYPE_CHECKING:
    from slime_search.algo.importance import ISConfig

LOSS_TYPES = ("policy_loss", "sft")


def loss_type_name(name: str) -> str:
    """slime spells the SFT loss `sft_loss`."""
    return "sft" if name == "sft_loss" else name


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = flag(
        "policy_loss",
        "policy_loss: GRPO's clipped policy gradient; sft: cross-entropy on the response tokens (slime's sft_loss is "
        "accepted)",
        type=loss_type_name,
        choices=LOSS_TYPES,
        slime=True,
    )
    eps_clip: float = flag(0.2, "PPO clip: the ratio is clipped below at 1 - eps", type=non_negative_float, slime=True)
    eps_clip_high: float = flag(
        0.28, "PPO clip-higher: the ratio is clipped above at 1 + eps-high", type=non_negative_float, slime=True
    )
    eps_clip_c: float | None = flag(
        None,
        "dual clip, > 1: a token with a negative advantage A costs at most -c x A however large its ratio (default: "
        "off)",
        type=float,
        slime=True,
    )
    # the KL term's weight: --kl-loss-coef with --use-kl-loss, else 0 (run_config)
    kl_coef: float = flag(
        0.0, "weight of the KL term in the loss", name="--kl-loss-coef", type=non_negative_float, slime=True
    )
    kl_loss_type: str = flag(
        "low_var_kl",
        "KL estimator: k1 log-ratio, k2 its square / 2, k3 = low_var_kl (clamped to [-10, 10])",
        choices=KL_ESTIMATORS,
        slime=True,
    )
    entropy_coef: float = flag(0.0, "weight of the entropy bonus", type=float, slime=True)
    llds_coef: float = flag(
        0.0,
        "weight of a likelihood-preserving term (LLDS-style): on responses whose likelihood fell below the old "
        "policy's, the tokens that lost likelihood are pushed back; acts from a rollout's second optimizer step "
        "(--global-batch-size below the rollout), 0: off",
        type=non_negative_float,
    )
    reduction: str = "sequence_mean"  # --calculate-per-token-loss: token_mean
    # vanilla TIS: clamp(exp(old - rollout), 0, tis_cap); off where MIS or a custom TIS function takes its place
    use_tis: bool = flag(
        False,
        "truncated importance sampling against the engine: each token's loss is weighted by clamp(p_trainer / "
        "p_engine, --tis-clip-low, --tis-clip)",
        slime=True,
    )
    tis_cap: float = flag(
        2.0, "upper clamp of the TIS weights", aliases=("--tis-clip",), type=positive_float, slime="--tis-clip"
    )
    mis: ISConfig | None = None  # the general form (levels, modes, rejection, veto, batch normalisation)
    # slime's --custom-tis-function-path (a backends.megatron.custom_tis.CustomTIS), in place of vanilla TIS
    custom_tis: Any = None
    temperature: float = 1.0  # --rollout-temperature: the engine's, which the log-probs are taken at
    vocab_size: int | None = None  # the real vocabulary: Megatron's padding columns are excluded

    @property
    def uses_old_log_probs(self) -> bool:
        """Whether the loss needs the policy's log-probs from before the step (PPO's ratio, TIS, MIS). SFT's does not:
        it is the demonstration's likelihood under the current weights, so no forward pass is spent on them."""
        return self.loss_type != "sft"

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown --loss-type {self.loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"unknown --kl-loss-type {self.kl_loss_type!r}; valid: {', '.join(KL_ESTIMATORS)}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; valid: {', '.join(REDUCTIONS)}")
        if self.use_tis and self.mis is not None:
            raise ValueError("choose vanilla TIS (--use-tis) or the general MIS configuration, not both")
        if self.custom_tis is not None and (self.use_tis or self.mis is not None or self.loss_type == "sft"):
            raise ValueError("a custom TIS function takes the place of vanilla TIS and MIS, in the policy loss only")
