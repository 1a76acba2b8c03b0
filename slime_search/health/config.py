"""The health guard's settings: which faults stop a run, which steps are skipped, and the bounds of every rule.

Every bound is a flag (`--health-*`, `--max-*`). The defaults were measured on the CPU miniature: they do not fire on
its healthy runs and they catch its collapses (docs/benchmarks/health.md). The reward and held-out drops are shares of
the run's own best beyond its own noise. They were chosen by simulation at the miniature's shape and the 3B recipe's
(benchmarks.studies.guard_shapes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_search.health.records import MIN_NORMS, spike_baseline_steps
from slime_search.utils.flag_fields import add_flags, flag, from_flags
from slime_search.utils.flag_types import (
    fraction,
    non_negative_float,
    non_negative_int,
    non_positive_float,
    positive_float,
    positive_int,
    probability,
)

MIN_WINDOW = MIN_NORMS  # the medians of the spike and length bounds need that many values


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = flag(
        True,
        "check every step against the rules below: warn, refuse an update, roll back to the last healthy "
        "checkpoint with a remedy (needs --save-interval). Off, a non-finite reward or gradient and a failing "
        "retriever still stop or skip as below",
        name="--health-guard",
    )
    # ---- what a rollout returns: stop or skip ---------------------------------------------------------------------
    max_reward_error_rate: float = flag(
        0.0,
        "share of a rollout's samples whose reward may be NaN, infinite, not a number, or raised; above it the "
        "step is not trained: the run stops with the first such error, or, when the plugin raised for a fault "
        "that passes (a timeout, a connection refused or reset, HTTP 5xx or 429), waits it out and redoes the "
        "rollout (--health-max-outage-hours); below it those samples leave the loss",
        type=fraction,
    )
    max_search_failure_rate: float = flag(
        0.05,
        "share of a rollout's search calls that may fail; above it the step is not trained on the trajectories "
        "that did not search: the run waits for the retriever and redoes the rollout (--health-max-outage-hours)",
        type=fraction,
    )
    max_skipped_steps: int = flag(
        3,
        "steps in a row that may be skipped (no trainable sample, a refused update) before the run stops with the"
        " cause",
        type=positive_int,
    )
    max_outage_hours: float = flag(
        6.0,
        "how long one continuous fault that passes is waited out: the retriever failing the step's searches, a "
        "reward service timing out, a --save disk too full for a checkpoint. The step's rollout (or the save) is "
        "tried again after 15 s, then after twice as long each time up to 5 minutes; past this many hours the run"
        " stops, and the same command resumes it once the fault is gone (0: stop at the first)",
        name="--health-max-outage-hours",
        type=non_negative_float,
    )
    # ---- the update: refused when the gradient is not finite or spikes --------------------------------------------
    grad_spike: float = flag(
        10.0,
        "an update whose gradient norm exceeds this many times the median of the recent applied ones is not applied",
        name="--health-grad-spike",
        type=positive_float,
    )
    # ---- warnings: a rule beyond its bound; `patience` steps in a row escalate to a rollback ----------------------
    window: int = flag(
        10,
        f"steps of history for baselines and medians (>= {MIN_WINDOW})",
        name="--health-window",
        type=positive_int,
    )
    entropy_low: float = flag(
        0.05,
        "warn when the policy's entropy falls below this times its value at the run's first step while the training "
        "reward is down (collapse); a surer policy with its reward up has learned",
        name="--health-entropy-low",
        type=positive_float,
    )
    entropy_high: float = flag(
        3.0,
        "warn when the policy's entropy rises above this times its value at the run's first step (explosion)",
        name="--health-entropy-high",
        type=positive_float,
    )
    max_logprob_gap: float = flag(
        0.1,
        "warn when the mean |trainer - engine| log-prob per token of the tokens sampled by the weights the "
        "trainer holds exceeds this (every token in synchronous mode, version lag 0 in asynchronous ones); an "
        "engine beyond it on the probe after a weight push (the same tokens teacher-forced on both sides) is "
        "restarted, and stops the run if it still is",
        name="--health-max-logprob-gap",
        type=positive_float,
    )
    max_is_capped_share: float = flag(
        0.2,
        "warn when this share of the tokens sampled by the weights the trainer holds has an importance weight "
        "beyond the TIS cap",
        name="--health-max-is-capped-share",
        type=fraction,
    )
    length_blowup: float = flag(
        2.5,
        "warn when the p90 response length exceeds this times its median over the last --health-window steps",
        name="--health-length-blowup",
        type=positive_float,
    )
    truncation_rise: float = flag(
        0.3,
        "warn when the share of a rollout's samples that hit a length budget rises this far above its start",
        name="--health-truncation-rise",
        type=fraction,
    )
    length_reward_dip: float = flag(
        0.05,
        "length and truncation warn (and escalate to a rollback) only while the training reward's window mean is "
        "this far below its best of the last 2 x --health-window steps, and beyond the reward's own noise (longer"
        " responses alone may be a policy learning to search more)",
        name="--health-length-reward-dip",
        type=fraction,
    )
    min_positive_shift: float = flag(
        -0.5,
        "warn when the tokens of rewarded responses lose more log-prob than this per token in an update "
        "(likelihood displacement: the policy drifts off what it was rewarded for)",
        name="--health-min-positive-shift",
        type=non_positive_float,
    )
    # 3 rolled back 4 more of 30 runs that recovered unaided (docs/benchmarks/health.md)
    patience: int = flag(
        4,
        "a warning that holds this many steps in a row rolls the run back; a trainer-engine mismatch is pushed "
        "again and the engines probed instead (asynchronous modes probe them this often anyway)",
        name="--health-patience",
        type=positive_int,
    )
    # ---- rollbacks: reward drops, or a warning that persists -------------------------------------------------------
    max_update_kl: float = flag(
        1.0,
        "roll back at once when one step moved the policy more than this KL(old || new) per token on the tokens "
        "it trained on",
        name="--health-max-update-kl",
        type=positive_float,
    )
    # the drops are shares of the run's own best, and must be beyond its noise as well (health.rules.reward and
    # held_out): one set of defaults for the miniature (EM 0.95) and the 3B recipe (0.42): benchmarks.studies.guard_shapes
    reward_drop: float = flag(
        0.3,
        "roll back when the training reward's window mean falls below its best by more than this share of the "
        "best, and by more than the reward's own noise allows",
        name="--health-reward-drop",
        type=positive_float,
    )
    eval_drop: float = flag(
        0.1,
        "a held-out metric (the reward's key) below its best by more than this share of the best (0.1: 0.095 at "
        "an EM of 0.95, 0.042 at 0.42), and beyond chance paired per question, is watched; --health-eval-patience"
        " evaluations in a row so far down roll the run back",
        name="--health-eval-drop",
        type=positive_float,
    )
    # health.md: 2 rolled back 5 of 14 healthy asynchronous runs that recovered, 4 none of them and still every run
    # that ended low
    eval_patience: int = flag(
        4,
        "held-out evaluations in a row that must fall by --health-eval-drop before a rollback (or fewer, see "
        "--health-eval-patience-steps): the first keeps the checkpoint of the last version within the margin and "
        "waits for the next (1: roll back at once)",
        name="--health-eval-patience",
        type=positive_int,
    )
    eval_patience_steps: int = flag(
        25,
        "fewer falls in a row than --health-eval-patience, two at least, roll the run back once they span this "
        "many steps of training: a dip that lasts so long is no passing one, however far apart the run evaluates",
        name="--health-eval-patience-steps",
        type=positive_int,
    )
    # the paired test and the confirmation on fresh questions guard against chance (health.md: benchmarks.studies.end_rule)
    end_drop: float = flag(
        0.05,
        "at the end of the run, when the final held-out evaluation is more than this below the best one of a kept"
        " checkpoint (and that best lies above the final evaluation's interval), the run ends on that "
        "checkpoint's weights: the engines serve them, RUN/final.json names them; the guard keeps it from "
        "--keep-checkpoints (0: off)",
        name="--health-end-drop",
        type=non_negative_float,
    )
    end_confirm: int = flag(
        500,
        "when the final held-out evaluation is more than --health-end-drop below a kept checkpoint's best but the"
        " evaluations cannot tell the fall from chance, both weights are evaluated on up to this many questions "
        "of the eval sets that --eval-sample or --eval-interval-width left out, paired per question, and the run "
        "ends on the checkpoint only if it is better there beyond chance (0: off; nothing to do when the "
        "evaluations grade every question)",
        name="--health-end-confirm",
        type=non_negative_int,
    )
    confirm_steps: int = flag(
        3,
        "a checkpoint becomes a rollback target once this many steps after it raised no warning; the guard keeps "
        "it from --keep-checkpoints",
        name="--health-confirm-steps",
        type=positive_int,
    )
    max_rollbacks: int = flag(
        2,
        "rollbacks within --health-rollback-window steps; one more stops the run with the rule, the step and the "
        "values (0: stop at the first)",
        type=non_negative_int,
    )
    rollback_window: int = flag(
        100,
        "steps a rollback counts against --max-rollbacks and lowers the learning rate; after that many healthy "
        "steps the budget and the learning rate are restored (0: for the whole run)",
        name="--health-rollback-window",
        type=non_negative_int,
    )
    lr_factor: float = flag(
        0.5,
        "a rollback's remedy: the learning rate is multiplied by this per rollback within "
        "--health-rollback-window steps (and in --async-mode fully the staleness bound lowered, then one-step)",
        name="--health-lr-factor",
        type=probability,
    )
    # measured by the actor after each update, read by the rules as train/kl_old_new and train/logp_shift_*
    probe_tokens: int = flag(
        512,
        "after each update, the log-probs of up to this many of each rank's tokens are computed again: how far the "
        "update moved the policy (train/kl_old_new, train/logp_shift_pos|neg); 0: not measured",
        name="--health-probe-tokens",
        type=non_negative_int,
    )
    # ---- where the rules apply (set from the run's phase, not flags) ----------------------------------------------
    engine_serves_policy: bool = True  # False with a demonstrator engine (SFT): no trainer-engine gap to watch
    rewards_grouped: bool = True  # False without reward groups (SFT): no reward signal or drop to watch
    synchronous: bool = True  # False in --async-mode one-step | fully: the engine rules read version lag 0 only, and
    # the engines are probed every --health-patience steps (health.rules.bounds, run.engine_check)
    adapters_from_zero: bool = False  # True with --lora-rank: each adapter's B starts at zero, so A's gradient does too; not from --lora-adapter-path
    # and the first updates' norms measure half the adapters (rising 10-30x over the first steps, docs/lora.md); the
    # gradient-spike yardstick waits for `window` applied steps instead of MIN_NORMS

    @property
    def spike_baseline_steps(self) -> int:
        """Applied steps before a gradient-norm spike is judged."""
        return spike_baseline_steps(self.window, self.adapters_from_zero)

    @property
    def max_outage_s(self) -> float:
        return self.max_outage_hours * 3600.0

    def __post_init__(self) -> None:
        if self.window < MIN_WINDOW:
            raise ValueError(f"--health-window must be >= {MIN_WINDOW} (the spike and length medians need that many)")
        if not 0 < self.lr_factor <= 1:
            raise ValueError(f"--health-lr-factor must be in (0, 1]: a rollback lowers the lr, got {self.lr_factor}")
        if self.entropy_low >= self.entropy_high:
            raise ValueError(
                f"--health-entropy-low ({self.entropy_low}) must be below --health-entropy-high ({self.entropy_high})"
            )


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training health (docs/benchmarks/health.md)")
    add_flags(g, HealthConfig)


def health_config(args: argparse.Namespace) -> HealthConfig:
    """The guard's rules from the flags, with where they apply from the run's phase (tools that replay records give
    no loss type)."""
    sft = getattr(args, "loss_type", None) == "sft"
    return from_flags(
        HealthConfig,
        args,
        engine_serves_policy=not sft,
        rewards_grouped=not sft,
        synchronous=getattr(args, "async_mode", "off") == "off",
        adapters_from_zero=bool(getattr(args, "lora_rank", 0)) and not getattr(args, "lora_adapter_path", None),
    )
