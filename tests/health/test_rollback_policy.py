"""The guard left alone: rules that apply only where their signal means something, remedies that fit the fault, a
budget that renews, and one rollback policy that both picks targets and tells pruning what to keep, so that no rule
ever finds its target pruned (--keep-checkpoints 2, a checkpoint every few steps, each rule in turn)."""

import math

import pytest

from slime_search.backends.megatron.checkpoint import prune_iterations
from slime_search.health.config import HealthConfig
from slime_search.health.guard import BEFORE, HealthGuard
from tests.health.test_guard import step_record


def sft_record(step, **extra):
    """An SFT step: the demonstrator's samples (another model: a large gap), one sample per prompt (no group)."""
    signal = {"rollout/zero_std_group_share": 1.0, "rollout/reward_std": 0.0}
    return step_record(step, **{"health/logprob_gap_lag0": 2.0, **signal, **extra})


def test_sft_steps_raise_no_engine_or_reward_warning():
    sft = HealthGuard(HealthConfig(engine_serves_policy=False, rewards_grouped=False))
    assert all(sft.review(step, sft_record(step)) == [] for step in range(20))
    rl = HealthGuard(HealthConfig())
    assert {e.rule for e in rl.review(0, sft_record(0))} == {"logprob_gap", "no_reward_signal"}
    # the reward of a demonstrator's samples is not the policy's: no reward drop in SFT either
    falling = HealthGuard(HealthConfig(window=4, engine_serves_policy=False, rewards_grouped=False))
    assert not any(falling.review(s, step_record(s, reward=r)) for s, r in enumerate([0.9, 0.9, 0.9, 0.1, 0.1, 0.1]))


def test_a_nan_entropy_neither_silences_the_entropy_rules_nor_passes_them():
    guard = HealthGuard(HealthConfig())
    assert guard.review(0, step_record(0, entropy=math.nan)) == []
    for step in range(1, 4):
        guard.review(step, step_record(step, entropy=1.0))  # the first finite value is the baseline
    assert [e.rule for e in guard.review(4, step_record(4, entropy=5.0))] == ["entropy_explosion"]


def test_a_lasting_rise_of_the_gradient_norm_becomes_the_new_level_instead_of_stopping_the_run():
    guard = HealthGuard(HealthConfig(grad_spike=10.0, max_skipped_steps=3))
    for step in range(4):
        guard.review(step, step_record(step, grad_norm=0.1))
    actions = []
    for step in range(4, 10):
        bound = guard.skip_above()
        applied = int(bound >= 1.5)  # as the optimizer decides against the bound
        actions.append([e.action for e in guard.review(step, step_record(step, grad_norm=1.5, applied=applied))])
    # two refusals at one level, then the bound follows it (10 x 1.5) and stays there
    assert actions == [["refuse"], ["refuse"], [], [], [], []]
    assert guard.skip_above() == pytest.approx(15.0)
    # a norm that keeps growing tenfold is no level: refused until the run stops
    exploding = HealthGuard(HealthConfig(grad_spike=10.0, max_skipped_steps=3))
    for step in range(4):
        exploding.review(step, step_record(step, grad_norm=0.1))
    last = []
    for step, norm in zip(range(4, 7), (1.5, 15.0, 150.0), strict=True):
        assert norm > exploding.skip_above()
        last = exploding.review(step, step_record(step, grad_norm=norm, applied=0))
    assert [e.action for e in last] == ["stop"]


def test_a_length_warning_that_cannot_escalate_does_not_block_confirmation():
    """A policy that learns to search writes longer answers while its reward rises: the truncation rule stays silent
    then, and when the reward dips for a while without a rollback, its warning does not keep the checkpoints after
    it from being confirmed once the reward is back up."""
    guard = HealthGuard(HealthConfig(confirm_steps=3, truncation_rise=0.3))
    for step in range(12):
        truncation = 0.1 if step < 4 else 0.6
        events = guard.review(
            step, step_record(step, reward=0.2 + 0.05 * step, **{"rollout/truncation_rate": truncation})
        )
        assert events == []
    assert guard.policy.target([0, 4, 8], before=12) == 8


def test_a_lasting_log_prob_gap_is_pushed_again_every_patience_steps_and_never_rolled_back():
    """A gap that survives a verified push is the engine's, which rolling the policy back cannot fix: each
    --health-patience steps of it are answered by a re-push and the probe of the engines (run.engine_check), and
    no checkpoint is kept for a rollback it never makes."""
    guard = HealthGuard(HealthConfig(patience=4))
    actions = []
    for step in range(12):
        gap = 0.0 if step < 2 else 1.5
        events = guard.review(step, step_record(step, **{"health/logprob_gap_lag0": gap}))
        actions.append([e.action for e in events if e.action != "warn"])
    assert [step for step, acted in enumerate(actions) if acted] == [5, 9]  # steps 2-5, then 6-9
    assert all(acted in ([], ["repush"]) for acted in actions)
    assert guard.escalation.streaks == {"logprob_gap": 10} and guard.escalation.anchors(11) == []
    # a gap that a re-push cured starts afresh: the next streak is re-pushed first again
    cured = HealthGuard(HealthConfig(patience=2))
    gaps = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    actions = [
        [e.action for e in cured.review(s, step_record(s, **{"health/logprob_gap_lag0": g}))]
        for s, g in enumerate(gaps)
    ]
    assert actions == [[], ["warn"], ["warn", "repush"], [], ["warn"], ["warn", "repush"]]


def test_the_rollback_budget_and_the_lr_remedy_renew_after_a_healthy_stretch():
    guard = HealthGuard(HealthConfig(max_rollbacks=2, rollback_window=100))
    guard.rollback_steps = [40, 90]
    assert guard.recent_rollbacks(100) == 2 and not guard.rollback_left(100)
    assert guard.recent_rollbacks(141) == 1 and guard.rollback_left(141)  # the one at step 40 aged out
    assert guard.recent_rollbacks(191) == 0
    lifetime = HealthGuard(HealthConfig(max_rollbacks=2, rollback_window=0))
    lifetime.rollback_steps = [40, 90]
    assert lifetime.recent_rollbacks(10_000) == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"window": 2}, "--health-window"),
        ({"lr_factor": 2.0}, "--health-lr-factor"),
        ({"entropy_low": 3.0, "entropy_high": 2.0}, "--health-entropy-low"),
    ],
)
def test_bounds_that_would_silently_disable_or_invert_a_rule_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        HealthConfig(**flags)


def run_with_pruning(config, records, save_every, keep, root):
    """Review `records` step by step, saving a checkpoint every `save_every` steps done and pruning as the driver
    does; returns the first rollback with the checkpoints kept then."""
    guard = HealthGuard(config)
    root.mkdir()
    for record in records:
        step = record["step"]
        rollback = next((e for e in guard.review(step, record) if e.action == "rollback"), None)
        if rollback is not None:
            return guard, rollback, sorted(int(p.name[5:]) for p in root.glob("iter_*"))
        if (step + 1) % save_every == 0:
            (root / f"iter_{step + 1:07d}").mkdir()
            (root / "latest_checkpointed_iteration.txt").write_text(str(step + 1))
            kept = sorted(int(p.name[5:]) for p in root.glob("iter_*"))
            prune_iterations(root, keep, tuple(guard.policy.needed(kept, guard.rollback_anchors())))
    raise AssertionError("no rollback")


SLOW_FALL = [step_record(s, reward=min(0.8, 0.04 * s) if s <= 20 else 0.8 - 0.006 * (s - 20)) for s in range(120)]
# a collapse that costs reward: 0.1 below its plateau, which is "down" but not the 0.3 x its best of a reward drop
ENTROPY_COLLAPSE = [step_record(s, entropy=1.0 if s < 37 else 0.01, reward=0.5 if s < 37 else 0.4) for s in range(60)]
POLICY_JUMP = [step_record(s, **{"train/kl_old_new": 0.01 if s < 43 else 5.0}) for s in range(60)]


@pytest.mark.parametrize(
    "name, records, config",
    [
        ("reward_drop", SLOW_FALL, HealthConfig()),
        ("entropy_collapse", ENTROPY_COLLAPSE, HealthConfig()),
        ("policy_jump", POLICY_JUMP, HealthConfig()),
    ],
)
def test_no_rule_finds_its_target_pruned_with_keep_two(tmp_path, name, records, config):
    guard, rollback, kept = run_with_pruning(config, records, save_every=10, keep=2, root=tmp_path / name)
    assert rollback.rule == name
    target = guard.policy.target(kept, int(rollback.values[BEFORE]))
    assert target is not None and target in kept and target <= rollback.values[BEFORE]
    assert len(kept) <= 2 + 4  # the newest two, and at most one target per anchor kind besides


def test_a_slow_reward_fall_rolls_back_near_the_best_not_to_where_it_began(tmp_path):
    """The reward rises to 0.8 by step 20 and falls 0.006 a step: the rule fires 0.3 x its best (0.79) below it, and
    the rollback goes to where the reward was still within half that margin of its best (about step 39), not back to
    step 20."""
    guard, rollback, kept = run_with_pruning(HealthConfig(), SLOW_FALL, save_every=10, keep=2, root=tmp_path / "ckpt")
    assert rollback.step == 64 and 35 <= rollback.values[BEFORE] <= 42
    assert rollback.values["margin"] == pytest.approx(0.3 * rollback.values["best"])  # a steady fall has no noise
    assert guard.policy.target(kept, int(rollback.values[BEFORE])) == 30


def test_the_held_out_rule_finds_its_target_kept(tmp_path):
    config = HealthConfig(eval_drop=0.2)
    guard = HealthGuard(config)
    root = tmp_path / "ckpt"
    root.mkdir()
    scores = {10: 0.5, 20: 0.7, 30: 0.72, 40: 0.7, 50: 0.6, 60: 0.45, 70: 0.4, 80: 0.45, 90: 0.3}
    rollback = None
    for step in range(91):
        guard.review(step, step_record(step))
        if step + 1 in scores or (step + 1) % 10 == 0:
            (root / f"iter_{step + 1:07d}").mkdir()
            (root / "latest_checkpointed_iteration.txt").write_text(str(step + 1))
        if step + 1 in scores:
            events = guard.review_eval(step + 1, {"eval/score": scores[step + 1]})
            rollback = next((e for e in events if e.action == "rollback"), rollback)
        kept = sorted(int(p.name[5:]) for p in root.glob("iter_*"))
        prune_iterations(root, 2, tuple(guard.policy.needed(kept, guard.rollback_anchors())))
        if rollback is not None:
            break
    # four falls in a row (versions 60-90), through which pruning at --keep-checkpoints 2 kept the target
    assert rollback.rule == "eval_drop" and rollback.step == 90 and rollback.values[BEFORE] == 50  # 0.6: within 0.2
    assert guard.policy.target(kept, 50) == 50 and 50 in kept


def test_a_held_out_rollback_goes_to_the_best_scored_version_past_early_gap_warnings(tmp_path):
    """Seed 3's one-step replica 3 (docs/benchmarks/health.md): log-prob gap warnings in the first steps (the policy
    moving fastest) left every early checkpoint unconfirmed, so a held-out rollback went back to step 0, past version 4
    that had scored 0.98. The version that scored the best evaluation yet is vouched for by the held-out set: the
    rollback goes there, and pruning at --keep-checkpoints 2 keeps it throughout the wait."""
    guard = HealthGuard(HealthConfig(eval_drop=0.2))
    root = tmp_path / "ckpt"
    root.mkdir()
    scores = {0: 0.0, 2: 0.5, 4: 0.98, 6: 0.9, 8: 0.6, 10: 0.5, 12: 0.55, 14: 0.5}
    rollback = None
    for step in range(15):
        gap = 0.14 if 2 <= step <= 5 else 0.01  # warned, never escalated
        guard.review(step, step_record(step, **{"health/logprob_gap_lag1": gap}))
        version = step + 1
        if version % 2 == 0:
            (root / f"iter_{version:07d}").mkdir()
            (root / "latest_checkpointed_iteration.txt").write_text(str(version))
        if version in scores:
            events = guard.review_eval(version, {"eval/score": scores[version]})
            rollback = next((e for e in events if e.action == "rollback"), rollback)
        kept = sorted(int(p.name[5:]) for p in root.glob("iter_*"))
        prune_iterations(root, 2, tuple(guard.policy.needed(kept, guard.rollback_anchors())))
        if rollback is not None:
            break
    assert rollback.rule == "eval_drop" and rollback.step == 14 and rollback.values[BEFORE] == 6
    # 6 (0.90) is within the margin but below the best and its confirmation window warned; 4 scored the best
    assert 4 in kept and guard.policy.target(kept, 6) == 4
    assert guard.policy.vouched() == {2, 4}


def test_trouble_that_comes_back_from_a_rollback_target_sends_the_next_rollback_further_back(tmp_path):
    """Seed 5's one-step replica 2 (docs/benchmarks/health.md): a length blow-up from step 13 rolled the run back to
    checkpoint 10 twice, came back step for step each time, and the run stopped. A checkpoint a recent rollback went
    back to is passed over for the one before it, which pruning at --keep-checkpoints 2 keeps for that (here the
    trouble is an explosion of the entropy, which holds as long as it lasts). The run's held-out plateau of 0.81 after a
    best of 0.98 is left within the held-out margin here (0.2 x the best): what is tested is the target passed over."""
    guard = HealthGuard(HealthConfig(patience=4, eval_drop=0.2))
    root = tmp_path / "ckpt"
    root.mkdir()
    scores = {2: 0.16, 4: 0.83, 6: 0.98, 8: 0.89, 10: 0.81, 12: 0.81, 14: 0.81, 16: 0.81}  # the run's held-out EM

    def run(steps, blowup_from):
        rollback = None
        for step in steps:
            entropy = 5.0 if step >= blowup_from else 1.0  # the trouble: an explosion that holds from `blowup_from`
            events = guard.review(step, step_record(step, entropy=entropy))
            rollback = next((e for e in events if e.action == "rollback"), None)
            if (step + 1) % 2 == 0:
                (root / f"iter_{step + 1:07d}").mkdir(exist_ok=True)
                (root / "latest_checkpointed_iteration.txt").write_text(str(step + 1))
                guard.review_eval(step + 1, {"eval/score": scores[step + 1]})
            kept = sorted(int(p.name[5:]) for p in root.glob("iter_*"))
            prune_iterations(root, 2, tuple(guard.checkpoints_needed(kept)))
            if rollback is not None:
                return rollback, sorted(int(p.name[5:]) for p in root.glob("iter_*"))
        raise AssertionError("no rollback")

    rollback, kept = run(range(17), blowup_from=13)
    assert rollback.rule == "entropy_explosion" and rollback.values[BEFORE] == 13
    first = guard.rollback_target(kept, 13)
    assert first == guard.policy.target(kept, 13) == 10  # the first time: the newest clean checkpoint
    guard.rolled_back(first, rollback.step)
    for path in root.glob("iter_*"):  # what the rollback undid is set aside
        if int(path.name[5:]) > first:
            path.rename(tmp_path / path.name)
    rollback, kept = run(range(first, 20), blowup_from=13)  # the same trouble at the same steps, from the same weights
    assert rollback.values[BEFORE] == 13
    assert guard.policy.target(kept, 13) == first  # where the policy alone would go again
    # version 6, the best held-out score, is vouched for and was kept: the second rollback goes there
    assert guard.rollback_target(kept, 13) == 6 and 6 in kept
    # a rollback outside --health-rollback-window no longer counts: its target is a target again
    old = HealthGuard(HealthConfig(rollback_window=5))
    old.rolled_back(4, at_step=6)
    for step in range(4, 20):
        old.review(step, step_record(step))
    assert old.rollback_target([0, 4], 19) == 4
