"""The faults of a guard week: what each is, how long it lasts, the right answer(s), what else it may cause, and where
in the run it is placed (each at a random step per seed, apart from the others).

An answer is (action, rule): a guard event of RUN/health.jsonl, or an action of the run the world records (an engine
restarted after it died, an evaluator replaced, the run resumed by its scheduler or its operator). A rule may be a tuple
of rules that answer alike, or ANY. Every answer of a fault must be given within its window; anything else there that
is not among its answers or what it may cause counts outside, as a false alarm or a harsher answer would.

    kind              lasts                         right answer(s)                            may also cause
    nan_rewards       3 steps: a tenth of the       warn reward_errors (the samples leave the
                      rewards NaN (miniature)       loss; 0.1 <= --max-reward-error-rate 0.25)
    retriever_outage  10 minutes of refused         pause search_failures, until it is over
                      searches
    reward_timeout    2 minutes of a reward         pause reward_errors (a transient kind)
                      service timing out
    disk_full         30 minutes: the --save disk   pause disk_full, then the save
                      full at a save
    engine_death      an engine dies mid-rollout    the engine restarted while the actor trains
                                                    (and it serves the next push)
    stale_engine      an engine's update lost,      repush                                     warn, and the probe's
                      until pushed again                                                       all-clear
    wrong_engine      an engine's log-probs 1.5     repush, probe, restart_engine, stop        warn; the operator
                      nats off, through restarts    naming it (on the newest checkpoint)       swaps it and resumes
    lr_spike          one update 100x too large     rollback policy_jump                       warn entropy_collapse
    slow_collapse     held-out 0.42 -> 0.25 (and    rollback (eval_drop or reward_drop)        watch eval_drop
                      the reward) over 100 updates
    fast_collapse     both to 0 over 10 updates     rollback (eval_drop, reward_drop or        watch, warn
                                                    no_reward_signal)                          no_reward_signal
    driver_kill       SIGKILL mid-rollout           the scheduler's resume, from the newest
                                                    checkpoint
    eval_hang         an evaluation never answers   beside: the evaluator replaced past its
                                                    deadline; in the step: the run ends with
                                                    an error naming --eval-timeout, resumed
"""

from __future__ import annotations

from dataclasses import dataclass

ANY = "*"
ENGINE = ("logprob_gap", "is_weight_tail")
PROBE = "engine_mismatch"
HELD_OUT_OR_REWARD = ("eval_drop", "reward_drop")
PASSING = ("retriever_outage", "reward_timeout", "disk_full")  # faults that pass: waited out, never a stop
COLLAPSES = ("slow_collapse", "fast_collapse")
RESTARTS = ("driver_kill", "wrong_engine")  # faults after which the driver is started again


@dataclass(frozen=True)
class Fault:
    answers: frozenset
    also: frozenset = frozenset()
    span: int = 2  # steps after its first step that its window lasts, before the evaluation lag


def faults_for(beside: bool, patience: int, eval_window: int) -> dict[str, Fault]:
    """The catalogue: `patience` (--health-patience) and `eval_window` (the steps a held-out fall needs to be seen:
    --health-eval-patience evaluations and their lag) size the windows of the engine and collapse faults."""
    hang = (
        {("evaluator_restart", "eval_timeout")} if beside else {("error", "eval_timeout"), ("resume", "eval_timeout")}
    )
    engine = 3 * patience
    return {
        "nan_rewards": Fault(frozenset({("warn", "reward_errors")}), span=2),
        "retriever_outage": Fault(frozenset({("pause", "search_failures")}), span=0),
        "reward_timeout": Fault(frozenset({("pause", "reward_errors")}), span=0),
        "disk_full": Fault(frozenset({("pause", "disk_full")}), span=0),
        "engine_death": Fault(frozenset({("engine_restart", "engine_down")}), span=1),
        "stale_engine": Fault(frozenset({("repush", ENGINE)}), frozenset({("warn", ENGINE), ("probe", PROBE)}), engine),
        "wrong_engine": Fault(
            frozenset({("repush", ENGINE), ("probe", PROBE), ("restart_engine", PROBE), ("stop", PROBE)}),
            frozenset({("warn", ENGINE), ("resume", "engine_swapped")}),
            engine,
        ),
        "lr_spike": Fault(frozenset({("rollback", "policy_jump")}), frozenset({("warn", "entropy_collapse")}), 1),
        "slow_collapse": Fault(
            frozenset({("rollback", HELD_OUT_OR_REWARD)}), frozenset({("watch", "eval_drop")}), 100 + eval_window
        ),
        "fast_collapse": Fault(
            frozenset({("rollback", (*HELD_OUT_OR_REWARD, "no_reward_signal"))}),
            frozenset({("watch", "eval_drop"), ("warn", "no_reward_signal")}),
            10 + eval_window,
        ),
        "driver_kill": Fault(frozenset({("resume", "driver_killed")}), span=0),
        "eval_hang": Fault(frozenset(hang), span=eval_window if beside else 0),
    }


def matches(event: tuple[str, str], answers) -> bool:
    """Whether (action, rule) is one of `answers` (a rule may be a tuple of rules that answer alike, or ANY)."""
    return any(
        event[0] == action and (rule == ANY or event[1] in (rule if isinstance(rule, tuple) else (rule,)))
        for action, rule in answers
    )


PLACEMENT_SPAN = 5  # steps a passing fault, a death or a kill keeps the next fault away (they do not last in steps)


def place(kinds, catalogue: dict[str, Fault], rng, steps: int, first: int, tail: int) -> dict[str, int]:
    """Each fault's step: in a random order, each after the previous one's window and a random gap, from `first` to
    `tail` steps before the end. An evaluation that hangs comes after the collapses: while it hangs the held-out rule is
    blind, and a collapse then would be the reward rule's alone. It also comes after the faults that start the driver
    again: a new driver has a new evaluator, and the hang would end unseen; its window may hold the other faults."""
    order = [str(k) for k in rng.permutation(list(kinds))]
    if "eval_hang" in order:
        order.remove("eval_hang")
        after = max((order.index(c) for c in (*COLLAPSES, *RESTARTS) if c in order), default=-1)
        order.insert(int(rng.integers(after + 1, len(order) + 1)), "eval_hang")
    spans = {k: 1 if k == "eval_hang" else max(PLACEMENT_SPAN, catalogue[k].span) for k in order}
    room = steps - tail - first - sum(spans.values())
    if room < 0:
        raise ValueError(f"{steps} steps cannot hold these faults apart: they need {steps - room} (use more --steps)")
    gaps = sorted(rng.integers(0, room + 1, len(order)))
    placed, cursor = {}, first
    for kind, gap, previous in zip(order, gaps, [0, *gaps[:-1]], strict=True):
        cursor += gap - previous
        placed[kind] = int(cursor)
        cursor += spans[kind]
    return placed
