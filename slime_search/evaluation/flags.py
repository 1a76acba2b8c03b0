"""The evaluation flags of the training CLI: what is evaluated, how often, and where (inside the step or beside it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_search.utils.flag_fields import add_flags, flag
from slime_search.utils.flag_types import non_negative_int, positive_float

# The deadline of one evaluation when --eval-timeout is not given: a start (an engine loads the version's weights and
# warms up) and an allowance per question graded. docs/benchmarks/eval.md measured 104 ms a question on the recipe's
# two engines (emulated, the client side the bound), about 0.21 s on the one engine of --eval-engine if the engines
# were; 0.5 s leaves more than 2x over that. The recipe's 3,000 questions get 2,400 s, the seven Search-R1 test sets
# (51,713 questions, 1,240-5,400 s on two engines) about 26,750 s.
EVAL_START_S = 900.0
EVAL_S_PER_QUESTION = 0.5


def eval_deadline_s(questions: int, timeout_s: float | None = None) -> float:
    """How long one evaluation of `questions` questions may take: `timeout_s` (--eval-timeout) when given, else
    EVAL_START_S plus EVAL_S_PER_QUESTION a question."""
    return timeout_s if timeout_s is not None else EVAL_START_S + EVAL_S_PER_QUESTION * questions


@dataclass(frozen=True)
class EvalConfig:
    prompt_data: tuple[str, ...] = flag(
        (), "pairs of name and path", name="--eval-prompt-data", nargs="+", metavar="NAME PATH", slime=True
    )
    interval: int = flag(
        0,
        "evaluate every N steps, and the start weights before the first (0: only at the end)",
        name="--eval-interval",
        type=non_negative_int,
        slime=True,
    )
    engine: bool = flag(
        False,
        "evaluate beside training, not inside the step: an engine of its own (a CPU engine server on a CPU machine, "
        "one SGLang engine of --rollout-num-gpus-per-engine spare GPUs on GPU) loads each eval-due version from an "
        "HF folder and is evaluated while training goes on; each result is recorded under its version",
        name="--eval-engine",
    )
    engine_url: str | None = flag(
        None,
        "with --eval-engine: an engine already running at this address evaluates (it loads each version from "
        "RUN/eval_weights, so it must see this machine's disk)",
        name="--eval-engine-url",
    )
    timeout: float | None = flag(
        None,
        "seconds one evaluation (loading its weights included) may take. Default: 900 s plus 0.5 s a question graded "
        "(the 3B recipe's 3,000: 2,400 s; the seven Search-R1 test sets whole: about 7.4 h). Beside training "
        "(--eval-engine) a later or failed one is dropped and the evaluator restarted (after 3 failures in a row the "
        "run goes on without evaluation); inside the step a late one ends the run with an error naming this flag "
        "(run again, it resumes); a late confirmation of the end on left-out questions ends on the last weights",
        name="--eval-timeout",
        type=positive_float,
    )

    def __post_init__(self) -> None:
        if len(self.prompt_data) % 2:
            raise ValueError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
        if self.engine_url and not self.engine:
            raise ValueError("--eval-engine-url names the engine of --eval-engine; add --eval-engine")

    @property
    def sets(self) -> tuple[tuple[str, str], ...]:
        """--eval-prompt-data NAME PATH [NAME PATH ...] as (name, path) pairs."""
        pairs = self.prompt_data
        return tuple(zip(pairs[::2], pairs[1::2], strict=True))


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("evaluation"), EvalConfig)
