"""The training reward, on the run's own scale: its mean over windows of `width` steps (--health-window / 2), measured
against the run's own step-to-step noise.

    down  the current window lies below the best window of the last 2 x --health-window steps by more than
          --health-length-reward-dip and by more than chance; the length and truncation warnings speak only then
          (longer answers with the reward up or level are a policy that learns to search more); it compares with the
          recent best, not the best of the whole run, which a noisy plateau exceeds by chance ever more often as the
          run goes on (tests/health/test_reward_rule.py)
    drop  the current window lies below the best window of the run by more than --health-reward-drop x that best and
          by more than chance: a rollback, to before the newest window still within half that margin of the best

Chance: the best of M independent window means is high by about sqrt(2 ln M) of their standard errors. The current one
may be low by Z more (DOWN_Z, DROP_Z). The standard error is the per-step standard deviation of the reward over
sqrt(width). That deviation comes from the reward's second differences over the last 5 x --health-window steps.
For independent noise r[t] - 2 r[t-1] + r[t-2] has variance 6 sd^2, and a steady rise or fall adds none to it. Their
median is taken, so that a jump or a kink does not count as noise. The state is the run's rewards in order.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import BEFORE, Event
from slime_search.health.records import num

KEY = "rollout/reward_mean"
RECENT = 2  # x --health-window: the windows the down gate's best is taken among
NOISE_SPAN = 5  # x --health-window: the steps whose spread is the noise
DOWN_Z = 2.0  # standard errors the current window may lie below by chance: "down" on ~0.5% of a plateau's steps
DROP_Z = 3.0  # a rollback: rarer still over a whole run (benchmarks.studies.guard_shapes)
MEDIAN_ABS_NORMAL = 0.6745  # median |x| of a standard normal
NOISE_DOUBT = 3.0  # the noise estimate from n second differences, raised by NOISE_DOUBT / sqrt(n) of itself


def step_noise(values: list[float]) -> float:
    """An upper bound of the per-step standard deviation of `values` (a reward per step); 0.0 before there are 5 second
    differences. The estimate from n of them is uncertain, since they are correlated: at n = 15 one run in 20 reads it
    below 0.55 of the truth. So it is taken NOISE_DOUBT / sqrt(n) of itself higher. A run's first steps, with the reward
    still low, are where an underestimate would read noise as a drop."""
    second = [abs(values[i] - 2 * values[i - 1] + values[i - 2]) for i in range(2, len(values))]
    if len(second) < 5:
        return 0.0
    estimate = statistics.median(second) / (MEDIAN_ABS_NORMAL * math.sqrt(6))
    return estimate * (1 + NOISE_DOUBT / math.sqrt(len(second)))


class RewardRule:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.width = max(1, config.window // 2)
        self.rewards: list[tuple[int, float]] = []  # (step, training reward) of every step that had one, in order
        self.means: list[tuple[int, float]] = []  # (first step, mean) of every window of `width` of them
        self.best: float | None = None  # the best of `means`

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        value = num(metrics, KEY)
        if value is None:
            return
        self.rewards.append((step, value))
        if len(self.rewards) >= self.width:
            window = self.rewards[-self.width :]
            self.means.append((window[0][0], sum(v for _, v in window) / self.width))
            self.best = max(self.means[-1][1], self.best if self.best is not None else self.means[-1][1])

    def forget_from(self, step: int) -> None:
        kept = [(s, v) for s, v in self.rewards if s < step]
        self.rewards, self.means, self.best = [], [], None
        for s, v in kept:
            self.observe(s, {KEY: v})

    def _with(self, step: int, metrics: dict[str, Any]) -> tuple[list[tuple[int, float]], list[float]]:
        """The windows and the per-step rewards (the last NOISE_SPAN windows' worth) with the step's own reward."""
        value = num(metrics, KEY)
        span = NOISE_SPAN * self.config.window
        if value is None:
            return self.means, [v for _, v in self.rewards[-span:]]
        rewards = [*self.rewards[-span:], (step, value)]
        means = self.means
        if len(rewards) >= self.width:
            window = rewards[-self.width :]
            means = [*means, (window[0][0], sum(v for _, v in window) / self.width)]
        return means, [v for _, v in rewards]

    def chance(self, values: list[float], windows: int, z: float) -> float:
        """How far the current window mean may lie below the best of `windows` of them by chance alone, in standard
        errors of one mean (from the per-step noise of `values`). The best of M independent windows is high by about
        sqrt(2 ln M) of them; windows overlap, so M = windows / width. The current one may be low by `z` more."""
        independent = max(1.0, windows / self.width)
        return step_noise(values) / math.sqrt(self.width) * (math.sqrt(2 * math.log(independent)) + z)

    def down(self, step: int, metrics: dict[str, Any]) -> bool:
        """Whether the training reward is down (see the module's docstring), with the step's own reward."""
        means, values = self._with(step, metrics)
        if len(means) < 2:
            return False
        recent = means[-RECENT * self.config.window :]
        margin = max(self.config.length_reward_dip, self.chance(values, len(recent), DOWN_Z))
        recent_best = max(mean for _, mean in recent)
        return recent_best - means[-1][1] > margin

    def drop_margin(self, best: float, means: list[tuple[int, float]], values: list[float]) -> float:
        return max(self.config.reward_drop * max(best, 0.0), self.chance(values, len(means), DROP_Z))

    def drop(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """A rollback when the step's window is below the run's best by the margin."""
        if not self.config.rewards_grouped:
            return []  # without reward groups (SFT) the reward is the demonstrator's, not the policy's
        means, values = self._with(step, metrics)
        if len(means) < 2:
            return []
        now = means[-1][1]
        best = now if self.best is None else max(self.best, now)
        margin = self.drop_margin(best, means, values)
        if best - now <= margin:
            return []
        message = (
            f"step {step}: training reward {now:.3f} (mean of {self.width} steps), {best - now:.3f} below its best "
            f"{best:.3f} (margin {margin:.3f}: --health-reward-drop {self.config.reward_drop} x the best, or the "
            "reward's own noise)"
        )
        before = newest_near_best(means, best, margin)
        values_out = {"value": now, "best": best, "margin": margin, BEFORE: float(before)}
        return [Event(step, "rollback", "reward_drop", message, values_out)]

    def anchor(self) -> int | None:
        """Where a reward drop would roll back to before, from the windows so far; None before there are any."""
        if not self.means or not self.config.rewards_grouped:
            return None
        best = self.best if self.best is not None else self.means[0][1]
        values = [v for _, v in self.rewards[-NOISE_SPAN * self.config.window :]]
        return newest_near_best(self.means, best, self.drop_margin(best, self.means, values))


def newest_near_best(means: list[tuple[int, float]], best: float, margin: float) -> int:
    """Where a reward drop rolls back to before: the first step of the newest window still within half the margin of
    the best. Not the best window's start, which may lie far back (a run that held near its best for long would lose
    all of it) and is not among the checkpoints pruning keeps; not the falling window's, whose weights are already on
    the way down."""
    return next(start for start, mean in reversed(means) if best - mean <= margin / 2)
