"""The evaluation flags of the training CLI: what is evaluated, how often, and where (inside the step or beside it)."""

from __future__ import annotations

import argparse

from slime_search.utils.flag_types import non_negative_int, positive_float


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-prompt-data", nargs="+", default=[], metavar="NAME PATH", help="pairs of name and path")
    g.add_argument(
        "--eval-interval",
        type=non_negative_int,
        default=0,
        help="evaluate every N steps, and the start weights before the first (0: only at the end)",
    )
    g.add_argument(
        "--eval-engine",
        action="store_true",
        help="evaluate beside training, not inside the step: an engine of its own (a CPU engine server on a CPU "
        "machine, one SGLang engine of --rollout-num-gpus-per-engine spare GPUs on GPU) loads each eval-due version "
        "from an HF folder and is evaluated while training goes on; each result is recorded under its version",
    )
    g.add_argument(
        "--eval-engine-url",
        default=None,
        help="with --eval-engine: an engine already running at this address evaluates (it loads each version from "
        "RUN/eval_weights, so it must see this machine's disk)",
    )
    g.add_argument(
        "--eval-timeout",
        type=positive_float,
        default=3600.0,
        help="with --eval-engine: seconds one evaluation (loading its weights included) may take; a later or failed "
        "one is dropped and the evaluator restarted (after 3 failures in a row the run goes on without evaluation)",
    )
