"""Which questions of each eval set an evaluation grades: all of them, a fixed number, or as many as a target
interval width needs. The draw is fixed-seed per set, each set its own stratum. It is the same on every machine and at
every evaluation of a run, so successive versions are graded on the same questions.

    --eval-sample N            N questions of each set (all of a smaller set)
    --eval-interval-width W    as many as make the 95% interval of a 0/1 score at most W wide (at 0.5, the widest)

A subset's samples carry the size of their set (metadata SET_SIZE_KEY), so that their interval is about the whole
set's score. That interval is narrower, by the finite-population factor, the larger the share of the set they are.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from slime_search.evaluation.intervals import questions_for_width
from slime_search.utils.flag_fields import add_flags, flag, from_flags
from slime_search.utils.flag_types import non_negative_int, positive_int

SET_SIZE_KEY = "eval_set_size"  # sample metadata: the size of the set a graded subset was drawn from
ROW_KEY = "eval_row"  # sample metadata: the question's row in its set's file (what pairs two runs without an index)


def interval_width(value: str) -> float:
    width = float(value)
    if not 0 < width < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {value}")
    return width


@dataclass(frozen=True)
class EvalSubset:
    # questions per set; None: every one (unless `width` sizes it)
    size: int | None = flag(
        None, "grade N questions of each eval set", name="--eval-sample", type=positive_int, exclusive="size"
    )
    # target 95% interval width of a 0/1 score
    width: float | None = flag(
        None,
        "grade as many questions of each set as make the 95%% interval of EM at most this wide (0.1: 385)",
        name="--eval-interval-width",
        type=interval_width,
        exclusive="size",
    )
    seed: int = flag(0, "which questions a subset holds (per set)", name="--eval-sample-seed", type=non_negative_int)

    def size_for(self, count: int) -> int:
        """How many of a set's `count` questions are graded."""
        if self.size is not None:
            return min(self.size, count)
        if self.width is not None:
            return questions_for_width(self.width, population=count)
        return count

    def indices(self, name: str, count: int) -> list[int]:
        """The graded rows of set `name` (of `count` rows), in file order."""
        return fixed_subset(count, self.size_for(count), self.seed, name)


@dataclass(frozen=True)
class UngradedQuestions:
    """At most `size` of the questions of each set that the evaluations' subset `graded` leaves out (a fixed-seed
    draw): fresh questions, on which a comparison the evaluations chose can be checked without their selection. A set
    the subset grades whole (Bamboogle's 125 questions under --eval-sample 500) has none."""

    graded: EvalSubset
    size: int

    def indices(self, name: str, count: int) -> list[int]:
        graded = set(self.graded.indices(name, count))
        rest = [i for i in range(count) if i not in graded]
        return [rest[i] for i in fixed_subset(len(rest), self.size, self.graded.seed, f"{name}:ungraded")]


def fixed_subset(count: int, size: int, seed: int, name: str) -> list[int]:
    """`size` of the indices 0..count-1, in order, the same for the same seed and set name on every machine."""
    if size >= count:
        return list(range(count))
    rng = random.Random(f"{seed}:{name}")
    return sorted(rng.sample(range(count), size))


def add_eval_subset_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("evaluation subsets"), EvalSubset)


def eval_subset(args: argparse.Namespace) -> EvalSubset:
    return from_flags(EvalSubset, args)


def set_size(samples) -> int | None:
    """The size of the set these samples are a subset of (None: they are the whole set, or sizes disagree)."""
    sizes = {sample.metadata.get(SET_SIZE_KEY) for sample in samples}
    return sizes.pop() if len(sizes) == 1 else None
