"""The health guard's settings: which faults stop a run, which steps are skipped, and the bounds of every rule.

Every bound is a flag (`--health-*`, `--max-*`); the defaults are the ones measured on the CPU miniature not to fire on
its healthy runs while catching its collapses (docs/benchmarks/health.md), and the reward and held-out drops, shares of
the run's own best beyond its own noise, by simulation at both the miniature's shape and the 3B recipe's
(benchmarks.guard_shapes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_search.utils.flag_types import (
    fraction,
    non_negative_float,
    non_negative_int,
    non_positive_float,
    positive_float,
    positive_int,
    probability,
)

MIN_WINDOW = 3  # the medians of the spike and length bounds need 3 values (records.MIN_NORMS)


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True  # --health-guard: the rules below warn, skip and roll back; off, only the hard stops remain
    # ---- what a rollout returns: stop or skip ---------------------------------------------------------------------
    max_reward_error_rate: float = 0.0  # above it, the run stops with the first bad reward
    max_search_failure_rate: float = 0.05  # above it, the step is skipped (not trained on the rest)
    max_skipped_steps: int = 3  # skipped steps in a row before the run stops
    max_outage_hours: float = 6.0  # a passing fault (searches, rewards, a full disk) is waited out this long
    # ---- the update: refused when the gradient is not finite or spikes --------------------------------------------
    grad_spike: float = 10.0  # x the median gradient norm of the recent applied steps
    # ---- warnings: a rule beyond its bound; `patience` steps in a row escalate to a rollback ----------------------
    window: int = 10  # steps of history for baselines and medians
    entropy_low: float = 0.05  # x the entropy at the first step: collapse
    entropy_high: float = 3.0  # x the entropy at the first step: explosion (gibberish)
    # mean |trainer - engine| log-prob per token of the tokens the trainer's weights sampled, and on the engine probe
    max_logprob_gap: float = 0.1
    max_is_capped_share: float = 0.2  # share of tokens whose importance weight the cap truncates
    length_blowup: float = 2.5  # x the recent median p90 response length
    truncation_rise: float = 0.3  # the share of samples that hit a length budget, above its starting value
    length_reward_dip: float = 0.05  # length rules speak only with the reward this far below its recent best
    min_positive_shift: float = -0.5  # the log-prob change of rewarded tokens after an update, per token
    patience: int = 4  # 3 rolled back 4 more of 30 runs that recovered unaided (docs/benchmarks/health.md)
    # ---- rollbacks: reward drops, or a warning that persists -------------------------------------------------------
    max_update_kl: float = 1.0  # KL(old || new) per token of one step: beyond it the update broke the policy
    # the drops are shares of the run's own best, and must be beyond its noise as well (health.rules.reward and
    # held_out): one set of defaults for the miniature (EM 0.95) and the 3B recipe (0.42): benchmarks.guard_shapes
    reward_drop: float = 0.3  # the training reward's window mean below its best by more than this x the best
    eval_drop: float = 0.1  # a held-out metric below its best by more than this x the best (and beyond chance)
    eval_patience: int = 4  # held-out falls in a row before a rollback (the first keeps its target); health.md: 2
    # rolled back 5 of 14 healthy asynchronous runs that recovered, 4 none of them and still every run that ended low
    eval_patience_steps: int = 25  # or two falls in a row or more that span this many steps (the recipe's interval)
    end_drop: float = 0.05  # the final held-out metric this far below the best kept checkpoint's: end on that (0: off);
    # the paired test and the confirmation on fresh questions guard against chance (health.md: benchmarks.end_rule)
    end_confirm: int = 500  # questions the evaluations left out on which an unsettled end_drop is confirmed (0: off)
    confirm_steps: int = 3  # a checkpoint is a rollback target once this many steps after it were clean
    max_rollbacks: int = 2  # within rollback_window steps; one more stops the run with the rule, the step and values
    rollback_window: int = 100  # steps a rollback counts against the budget and lowers the lr (0: the whole run)
    lr_factor: float = 0.5  # a rollback's remedy: the learning rate times this, per recent rollback
    # ---- where the rules apply (set from the run's phase, not flags) ----------------------------------------------
    engine_serves_policy: bool = True  # False with a demonstrator engine (SFT): no trainer-engine gap to watch
    rewards_grouped: bool = True  # False without reward groups (SFT): no reward signal or drop to watch
    synchronous: bool = True  # False in --async-mode one-step | fully: the engine rules read version lag 0 only, and
    # the engines are probed every --health-patience steps (health.rules.bounds, health.engine_check)

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
    g.add_argument(
        "--health-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every step against the rules below: warn, refuse an update, roll back to the last healthy "
        "checkpoint with a remedy (needs --save-interval). Off, a non-finite reward or gradient and a failing "
        "retriever still stop or skip as below",
    )
    g.add_argument(
        "--max-reward-error-rate",
        type=fraction,
        default=0.0,
        help="share of a rollout's samples whose reward may be NaN, infinite, not a number, or raised; above it the "
        "step is not trained: the run stops with the first such error, or, when the plugin raised for a fault that "
        "passes (a timeout, a connection refused or reset, HTTP 5xx or 429), waits it out and redoes the rollout "
        "(--health-max-outage-hours); below it those samples leave the loss",
    )
    g.add_argument(
        "--max-search-failure-rate",
        type=fraction,
        default=0.05,
        help="share of a rollout's search calls that may fail; above it the step is not trained on the trajectories "
        "that did not search: the run waits for the retriever and redoes the rollout (--health-max-outage-hours)",
    )
    g.add_argument(
        "--max-skipped-steps",
        type=positive_int,
        default=3,
        help="steps in a row that may be skipped (no trainable sample, a refused update) before the run stops with "
        "the cause",
    )
    g.add_argument(
        "--health-max-outage-hours",
        type=non_negative_float,
        default=6.0,
        help="how long one continuous fault that passes is waited out: the retriever failing the step's searches, a "
        "reward service timing out, a --save disk too full for a checkpoint. The step's rollout (or the save) is "
        "tried again after 15 s, then after twice as long each time up to 5 minutes; past this many hours the run "
        "stops, and the same command resumes it once the fault is gone (0: stop at the first)",
    )
    g.add_argument(
        "--health-grad-spike",
        type=positive_float,
        default=10.0,
        help="an update whose gradient norm exceeds this many times the median of the recent applied ones is not "
        "applied",
    )
    g.add_argument(
        "--health-probe-tokens",
        type=non_negative_int,
        default=512,
        help="after each update, the log-probs of up to this many of each rank's tokens are computed again: how far "
        "the update moved the policy (train/kl_old_new, train/logp_shift_pos|neg); 0: not measured",
    )
    g.add_argument(
        "--health-window",
        type=positive_int,
        default=10,
        help=f"steps of history for baselines and medians (>= {MIN_WINDOW})",
    )
    g.add_argument(
        "--health-entropy-low",
        type=positive_float,
        default=0.05,
        help="warn when the policy's entropy falls below this times its value at the run's first step (collapse)",
    )
    g.add_argument(
        "--health-entropy-high",
        type=positive_float,
        default=3.0,
        help="warn when the policy's entropy rises above this times its value at the run's first step (explosion)",
    )
    g.add_argument(
        "--health-max-logprob-gap",
        type=positive_float,
        default=0.1,
        help="warn when the mean |trainer - engine| log-prob per token of the tokens sampled by the weights the "
        "trainer holds exceeds this (every token in synchronous mode, version lag 0 in asynchronous ones); an engine "
        "beyond it on the probe after a weight push (the same tokens teacher-forced on both sides) is restarted, and "
        "stops the run if it still is",
    )
    g.add_argument(
        "--health-max-is-capped-share",
        type=fraction,
        default=0.2,
        help="warn when this share of the tokens sampled by the weights the trainer holds has an importance weight "
        "beyond the TIS cap",
    )
    g.add_argument(
        "--health-length-blowup",
        type=positive_float,
        default=2.5,
        help="warn when the p90 response length exceeds this times its median over the last --health-window steps",
    )
    g.add_argument(
        "--health-truncation-rise",
        type=fraction,
        default=0.3,
        help="warn when the share of a rollout's samples that hit a length budget rises this far above its start",
    )
    g.add_argument(
        "--health-length-reward-dip",
        type=fraction,
        default=0.05,
        help="length and truncation warn (and escalate to a rollback) only while the training reward's window mean is "
        "this far below its best of the last 2 x --health-window steps, and beyond the reward's own noise (longer "
        "responses alone may be a policy learning to search more)",
    )
    g.add_argument(
        "--health-min-positive-shift",
        type=non_positive_float,
        default=-0.5,
        help="warn when the tokens of rewarded responses lose more log-prob than this per token in an update "
        "(likelihood displacement: the policy drifts off what it was rewarded for)",
    )
    g.add_argument(
        "--health-max-update-kl",
        type=positive_float,
        default=1.0,
        help="roll back at once when one step moved the policy more than this KL(old || new) per token on the tokens "
        "it trained on",
    )
    g.add_argument(
        "--health-patience",
        type=positive_int,
        default=4,
        help="a warning that holds this many steps in a row rolls the run back; a trainer-engine mismatch is pushed "
        "again and the engines probed instead (asynchronous modes probe them this often anyway)",
    )
    g.add_argument(
        "--health-reward-drop",
        type=positive_float,
        default=0.3,
        help="roll back when the training reward's window mean falls below its best by more than this share of the "
        "best, and by more than the reward's own noise allows",
    )
    g.add_argument(
        "--health-eval-drop",
        type=positive_float,
        default=0.1,
        help="a held-out metric (the reward's key) below its best by more than this share of the best (0.1: 0.095 at "
        "an EM of 0.95, 0.042 at 0.42), and beyond chance paired per question, is watched; "
        "--health-eval-patience evaluations in a row so far down roll the run back",
    )
    g.add_argument(
        "--health-eval-patience",
        type=positive_int,
        default=4,
        help="held-out evaluations in a row that must fall by --health-eval-drop before a rollback (or fewer, see "
        "--health-eval-patience-steps): the first keeps the checkpoint of the last version within the margin and "
        "waits for the next (1: roll back at once)",
    )
    g.add_argument(
        "--health-eval-patience-steps",
        type=positive_int,
        default=25,
        help="fewer falls in a row than --health-eval-patience, two at least, roll the run back once they span this "
        "many steps of training: a dip that lasts so long is no passing one, however far apart the run evaluates",
    )
    g.add_argument(
        "--health-end-drop",
        type=non_negative_float,
        default=0.05,
        help="at the end of the run, when the final held-out evaluation is more than this below the best one of a "
        "kept checkpoint (and that best lies above the final evaluation's interval), the run ends on that "
        "checkpoint's weights: the engines serve them, RUN/final.json names them; the guard keeps it from "
        "--keep-checkpoints (0: off)",
    )
    g.add_argument(
        "--health-end-confirm",
        type=non_negative_int,
        default=500,
        help="when the final held-out evaluation is more than --health-end-drop below a kept checkpoint's best but "
        "the evaluations cannot tell the fall from chance, both weights are evaluated on up to this many questions "
        "of the eval sets that --eval-sample or --eval-interval-width left out, paired per question, and the run "
        "ends on the checkpoint only if it is better there beyond chance (0: off; nothing to do when the "
        "evaluations grade every question)",
    )
    g.add_argument(
        "--health-confirm-steps",
        type=positive_int,
        default=3,
        help="a checkpoint becomes a rollback target once this many steps after it raised no warning; the guard "
        "keeps it from --keep-checkpoints",
    )
    g.add_argument(
        "--max-rollbacks",
        type=non_negative_int,
        default=2,
        help="rollbacks within --health-rollback-window steps; one more stops the run with the rule, the step and "
        "the values (0: stop at the first)",
    )
    g.add_argument(
        "--health-rollback-window",
        type=non_negative_int,
        default=100,
        help="steps a rollback counts against --max-rollbacks and lowers the learning rate; after that many healthy "
        "steps the budget and the learning rate are restored (0: for the whole run)",
    )
    g.add_argument(
        "--health-lr-factor",
        type=probability,
        default=0.5,
        help="a rollback's remedy: the learning rate is multiplied by this per rollback within "
        "--health-rollback-window steps (and in --async-mode fully the staleness bound lowered, then one-step)",
    )


def health_config(args: argparse.Namespace) -> HealthConfig:
    return HealthConfig(
        enabled=args.health_guard,
        max_reward_error_rate=args.max_reward_error_rate,
        max_search_failure_rate=args.max_search_failure_rate,
        max_skipped_steps=args.max_skipped_steps,
        max_outage_hours=args.health_max_outage_hours,
        grad_spike=args.health_grad_spike,
        window=args.health_window,
        entropy_low=args.health_entropy_low,
        entropy_high=args.health_entropy_high,
        max_logprob_gap=args.health_max_logprob_gap,
        max_is_capped_share=args.health_max_is_capped_share,
        length_blowup=args.health_length_blowup,
        truncation_rise=args.health_truncation_rise,
        length_reward_dip=args.health_length_reward_dip,
        min_positive_shift=args.health_min_positive_shift,
        max_update_kl=args.health_max_update_kl,
        patience=args.health_patience,
        reward_drop=args.health_reward_drop,
        eval_drop=args.health_eval_drop,
        eval_patience=args.health_eval_patience,
        eval_patience_steps=args.health_eval_patience_steps,
        end_drop=args.health_end_drop,
        end_confirm=args.health_end_confirm,
        confirm_steps=args.health_confirm_steps,
        max_rollbacks=args.max_rollbacks,
        rollback_window=args.health_rollback_window,
        lr_factor=args.health_lr_factor,
        engine_serves_policy=getattr(args, "loss_type", None) != "sft",  # tools that replay records give no loss
        rewards_grouped=getattr(args, "loss_type", None) != "sft",
        synchronous=getattr(args, "async_mode", "off") == "off",
    )
