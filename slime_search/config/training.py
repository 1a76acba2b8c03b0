"""The run's training flags beyond the loss's and the optimizer's own fields. They set its length, the optimizer step's
size, the advantage estimator, the KL reference, the loss's reduction, the micro-batches, and the general form of the
importance weights. They are declared as the fields of `TrainingConfig` and `ImportanceWeightsConfig`; slime's names).
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.algo.importance import IS_LEVELS, IS_MODES, ISConfig
from slime_search.utils.flag_fields import REQUIRED, flag
from slime_search.utils.flag_types import non_negative_float, non_negative_int, positive_float, positive_int

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class TrainingConfig:
    num_rollout: int = flag(
        REQUIRED,
        "rollouts, each followed by training (0: no training, only the final evaluation of the start weights)",
        type=non_negative_int,
        slime=True,
    )
    global_batch_size: int | None = flag(
        None,
        "samples per optimizer step (default: all the rollout's, one step per rollout)",
        type=positive_int,
        slime=True,
    )
    advantage_estimator: str = flag(
        "grpo",
        "grpo: reward minus its group's mean, divided by the group's std; dr_grpo: not divided",
        choices=ADVANTAGE_ESTIMATORS,
        slime=True,
        switches=(
            (
                "--disable-grpo-std-normalization",
                "dr_grpo",
                "slime's spelling of --advantage-estimator dr_grpo",
                True,
            ),
        ),
    )
    use_kl_loss: bool = flag(False, "KL to the reference model (--kl-loss-coef)", slime=True)
    calculate_per_token_loss: bool = flag(
        False,
        "average the loss over every response token of the step (token_mean); default: over each sequence's tokens, "
        "then over the sequences (sequence_mean)",
        slime=True,
    )
    max_tokens_per_gpu: int = flag(4096, "token budget of a packed micro-batch", type=positive_int, slime=True)

    @property
    def reduction(self) -> str:
        return "token_mean" if self.calculate_per_token_loss else "sequence_mean"


@dataclass(frozen=True)
class ImportanceWeightsConfig:
    """How the loss weights tokens against the engine's sampling beyond vanilla TIS (LossConfig's --use-tis and
    --tis-clip): a lower clamp, a custom function in TIS's place, or the general form (--use-mis)."""

    tis_clip_low: float = flag(0.0, "lower clamp of the TIS weights (0: none)", type=non_negative_float, slime=True)
    custom_tis_function_path: str | None = flag(
        None,
        "module.function in place of vanilla TIS, with --use-tis (slime's): called on every micro-batch as "
        "fn(args, pg_loss=..., train_log_probs=[...], rollout_log_probs=[...], loss_masks=[...], total_lengths=[...], "
        "response_lengths=[...]) -> (weighted pg_loss, masks, metrics); tokens its masks take out leave the loss, its "
        "metrics are logged as train/NAME. slime's TIS/MIS helper: examples.train_infer_mismatch_helper.mis."
        "compute_mis_weights_with_cp with --custom-config-path .../mis.yaml",
        slime=True,
    )
    use_mis: bool = flag(
        False,
        "importance weights in their general form (--mis-level, --mis-mode, bounds), normalised to mean 1 over the "
        "global batch: every micro-batch and data-parallel rank of the optimizer step together (instead of "
        "--use-tis)",
    )
    mis_level: str = flag(
        "token",
        "token: a weight per token; sequence: the product of the response's ratios; geometric: their geometric mean",
        choices=IS_LEVELS,
    )
    mis_mode: str = flag(
        "truncate",
        "truncate: min(w, upper); clip: clamp(w, lower, upper); mask: tokens with w outside [lower, upper] leave the "
        "loss",
        choices=IS_MODES,
    )
    mis_upper: float = flag(2.0, "upper bound of the MIS weights", type=positive_float)
    mis_lower: float | None = flag(
        None, "lower bound of the MIS weights (default: 1 / --mis-upper)", type=non_negative_float
    )
    mis_veto_threshold: float | None = flag(
        None,
        "a sequence holding a token whose ratio is below this leaves the loss (default: off)",
        type=positive_float,
    )
    mis_batch_normalize: bool = flag(True, "normalise the MIS weights to mean 1 over the global batch")

    def __post_init__(self) -> None:
        if self.use_mis:
            lower = self.mis_lower if self.mis_lower is not None else 1.0 / self.mis_upper
            if lower >= self.mis_upper:
                given = f"{lower:g}" if self.mis_lower is not None else f"(by default 1 / --mis-upper = {lower:g})"
                raise ValueError(f"--mis-lower {given} must be below --mis-upper {self.mis_upper:g}")

    def resolve(self, use_tis: bool, tis_cap: float) -> tuple[bool, ISConfig | None]:
        """LossConfig's (use_tis, mis): vanilla TIS, the general form, or neither (also when a custom TIS function
        takes vanilla TIS's place)."""
        if self.custom_tis_function_path is not None:
            return False, None
        if self.use_mis:
            return False, ISConfig(
                level=self.mis_level,
                mode=self.mis_mode,
                upper=self.mis_upper,
                lower=self.mis_lower,
                veto_threshold=self.mis_veto_threshold,
                batch_normalize=self.mis_batch_normalize,
            )
        if use_tis and self.tis_clip_low > 0:
            # slime's clamp(w, --tis-clip-low, --tis-clip) per token is the general form at token level in clip mode
            return False, ISConfig(level="token", mode="clip", upper=tis_cap, lower=self.tis_clip_low)
        return use_tis, None
