"""The simulated world of a guard week. It holds the run's clock, the actor's weights as a point on a learning curve,
and the held-out questions. It holds the faults to come; each fires once, by step or over a span of the clock. For the
judge, it records what the run did that is not a guard event: an engine restarted, an evaluator replaced, the run
resumed.

The weights embody `progress` healthy updates (each applied update adds the learning rate's scale, so a rollback's
remedy slows learning); an lr spike breaks them; a collapse begins at its step and deepens with every update on the
timeline that began it (the batches it drew: a rollback's redone steps draw others); from a checkpoint within it the
weights collapse on once they are past NO_RETURN of the fall, else heal (a checkpoint from before it is healthy).
Evaluations grade each
question right when its latent difficulty is below the version's accuracy on its set (binomial at that accuracy), a
share of the difficulties drawn anew per evaluation (benchmarks.studies.guard_shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmarks.studies.guard_week.shapes import WeekSetup, set_level

COLLAPSES = {"slow_collapse": (0.25 / 0.42, 100), "fast_collapse": (0.0, 10)}  # the floor (x the level), the steps
NO_RETURN = 0.25  # the share of its fall past which a collapse deepens on its own (before it, fresh batches heal it)
BROKEN_ACCURACY = 0.02  # what a policy an lr spike broke still gets right
PASSING_S = {"retriever_outage": 600.0, "reward_timeout": 120.0, "disk_full": 1800.0}  # how long each lasts


class DriverKilled(BaseException):
    """The driver SIGKILLed: nothing of it runs on (a BaseException, so that no `except Exception` of the run sees it)."""


class SimClock:
    """The run's clock (RunParts.clock): seconds of simulated time; a sleep passes at once."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


@dataclass(frozen=True)
class Weights:
    progress: float = 0.0  # healthy updates the weights embody
    broken: bool = False
    collapse: str | None = None  # a collapse the weights are in (COLLAPSES)
    fallen: float = 0.0  # updates taken since it began

    def factor(self) -> float:
        """What the collapse leaves of the healthy accuracy (guard_shapes.collapse_factor's linear fall)."""
        if self.collapse is None:
            return 1.0
        floor, steps = COLLAPSES[self.collapse]
        return 1.0 - (1.0 - floor) * min(1.0, self.fallen / steps)


@dataclass
class Facts:
    """What the run did besides the guard's events, and what the judge checks against."""

    events: list[dict] = field(default_factory=list)  # the guard's events, every one as it was recorded
    actions: list[tuple[int, str, str]] = field(default_factory=list)  # (step, action, rule)
    met: dict[str, list[int]] = field(default_factory=dict)  # a passing fault -> the steps whose tries met it
    saved: int = 0  # checkpoints written
    pruned: int = 0  # removed by --keep-checkpoints
    peak_bytes: int = 0
    peak_folders: list[str] = field(default_factory=list)  # the checkpoints on disk at the peak
    newest: int | None = None  # the newest checkpoint of the run's timeline (a rollback's target after it)
    newest_before_load: int | None = None  # ... before the last checkpoint the actor loaded
    stops: list[dict] = field(default_factory=list)  # each stop: its event, final.json then, the newest checkpoint
    resumed: list[dict] = field(default_factory=list)  # each start after the first: why, from which checkpoint
    served_after_restart: list[tuple[int, bool]] = field(default_factory=list)  # (step, the engine served the push)
    bad_engine: str | None = None  # the engine whose log-probs went wrong
    eval_blind_s: float = 0.0  # seconds an evaluation hung before it was dropped


class World:
    """The world the run's parts live in; it outlasts the driver (a SIGKILL and a resume meet the same world)."""

    def __init__(self, week: WeekSetup, rng, faults: dict[str, int]):
        self.week, self.shape, self.config = week, week.shape, week.config
        self.rng = rng
        self.clock = SimClock()
        self.faults = dict(faults)  # kind -> the step it fires at (once)
        self.fired: set[str] = set()
        self.spans: dict[str, tuple[float, float]] = {}  # a passing fault -> (from, to) on the clock
        self.facts = Facts()
        self.urls = [f"http://10.0.0.{i + 2}:30000" for i in range(week.engines)]
        self.bad_hardware: set[str] = set()  # engines whose log-probs are wrong whatever they serve
        self.latent = {name: rng.random(n) for name, n in week.eval_sizes.items()}
        self.fresh: dict[str, object] = {}  # latent difficulty of the questions the evaluations leave out
        self.manager = None  # the running driver's SimManager (the step it is at)
        self.collapse_attempt: dict[str, int] = {}  # a collapse -> the sampling attempt (timeline) it began in

    # ---- faults ----------------------------------------------------------------------------------------------------
    def due(self, kind: str, step: int) -> bool:
        """Whether `kind` fires now (the first time the run reaches its step); it fires once."""
        if kind in self.faults and kind not in self.fired and step >= self.faults[kind]:
            self.fired.add(kind)
            return True
        return False

    def begin_span(self, kind: str, at: float) -> None:
        self.spans[kind] = (at, at + PASSING_S[kind])

    def share(self, kind: str, start: float, end: float) -> float:
        """The share of [start, end] a passing fault covers."""
        if kind not in self.spans or end <= start:
            return 0.0
        a, b = self.spans[kind]
        return max(0.0, min(end, b) - max(start, a)) / (end - start)

    def active(self, kind: str, at: float) -> bool:
        return kind in self.spans and self.spans[kind][0] <= at < self.spans[kind][1]

    def met(self, kind: str, step: int) -> None:
        self.facts.met.setdefault(kind, []).append(step)

    def note(self, step: int, action: str, rule: str) -> None:
        """An action of the run that is not a guard event (the judge counts it with them)."""
        self.facts.actions.append((step, action, rule))

    def deepens(self, collapse: str, fallen: float, attempt: int) -> bool:
        """Whether an update deepens a collapse the weights are in: on the timeline that began it (the batches it drew
        keep pushing), or anywhere once it is past NO_RETURN of its fall; else the update heals it by one."""
        return attempt == self.collapse_attempt.get(collapse) or fallen >= NO_RETURN * COLLAPSES[collapse][1]

    # ---- the learning curve ----------------------------------------------------------------------------------------
    def reward_accuracy(self, weights: Weights) -> float:
        if weights.broken:
            return BROKEN_ACCURACY
        return self.shape.curve(self.shape.reward_level, weights.progress) * weights.factor()

    def em_accuracy(self, weights: Weights) -> float:
        if weights.broken:
            return BROKEN_ACCURACY
        return self.shape.curve(self.shape.em_level, weights.progress) * weights.factor()

    def draw(self, lo_hi: tuple[float, float]) -> float:
        return float(self.rng.uniform(*lo_hi))

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def eval_seconds(self, questions: int, load: bool) -> float:
        timing = self.shape.timing
        return (timing.eval_load_s if load else 0.0) + questions * self.draw(timing.eval_s_per_question)

    def grade(self, weights: Weights, sizes: dict[str, int] | None = None, fresh: bool = False) -> dict:
        """The evaluation's metrics and per-question grades (in set order) of `weights`; `fresh`: on the questions
        the evaluations leave out (`sizes` of them per set), the same ones at every call."""
        import numpy as np

        from slime_search.evaluation.intervals import bootstrap_interval
        from slime_search.rollout.eval_metrics import GRADES

        accuracy, metrics, grades = self.em_accuracy(weights), {}, []
        for name, n in (sizes or self.week.eval_sizes).items():
            if fresh:
                latent = self.fresh.setdefault(name, self.rng.random(n))[:n]
            else:
                redraw = self.rng.random(n) < self.shape.resample
                latent = self.latent[name] = np.where(redraw, self.rng.random(n), self.latent[name])
            right = (latent < min(1.0, accuracy * set_level(name))).astype(float)
            metrics[f"eval/{name}/score"] = float(right.mean()) if n else 0.0
            grades.append(right)
        every = np.concatenate(grades) if grades else np.zeros(0)
        interval = bootstrap_interval(every.tolist())
        key = f"eval/{self.config.rollout.rollout.reward_key}"
        metrics.update({key: interval.mean, f"{key}_low": interval.low, f"{key}_high": interval.high})
        return {**metrics, "eval/n": float(every.size), GRADES: every.tolist()}


def logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))
