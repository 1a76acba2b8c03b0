"""The two shapes a guard week stands for: the run's configuration, built by our parser and run_config from the flags
the run takes, and the world's timings, curves and sizes at that shape.

    recipe     examples/search-r1/run_qwen2.5_3B.sh as `DRY_RUN=1` prints it (benchmarks.harness.recipe.recipe_flags):
               1,000 steps of 32 prompts x 8 samples, checkpoints every 20 and every evaluated version, held-out EM on
               nq_test[0:3000] every 25 inside the step, --keep-checkpoints 2, every health bound at its default; two
               SGLang engines of TP 2, the actor at TP 2 x DP 2 in bf16 (43.2 GB a checkpoint). With --eval-beside:
               --eval-engine and the seven Search-R1 test sets whole (51,713 questions) in place of nq_test.
    miniature  the CPU main job's guard week as before: 300 steps of 8 prompts x 8 samples, one CPU engine, 64 held-out
               questions, evaluation and checkpoints every 10, --keep-checkpoints 2, --max-reward-error-rate 0.25,
               TIS; the tiny Qwen2 of scripts/models/tiny-qwen2.sh in fp32 at TP 1.

What a simulation must change of the recipe's command line (WEEK_OVERRIDES). --save becomes a folder of the week's. The
eval sets' paths become placeholder files of the sets' real row counts, so that the product counts their questions,
slices and --eval-sample as it does. Extra flags come with --recipe-flags. Everything else, and every default it
implies, is the recipe's. Parts the week does not use (the model and data paths, Ray's placement, the transport's kind)
are parsed and left as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.curves import SHAPES as CURVES
from benchmarks.harness.curves import healthy

# Search-R1's test sets (FlashRAG's copies: NQ and TriviaQA test, PopQA test, the dev sets of HotpotQA, 2Wiki and
# MuSiQue, Bamboogle's test), their sizes and the 3B base model's EM on each in the order of Search-R1's table
# (NQ 0.421, as docs/benchmarks/eval.md cites it); only the levels' ratios to NQ enter the simulation.
SEARCH_R1_SETS = {
    "nq": (3610, 0.421),
    "triviaqa": (11313, 0.583),
    "popqa": (14267, 0.413),
    "hotpotqa": (7405, 0.297),
    "2wiki": (12576, 0.274),
    "musique": (2417, 0.066),
    "bamboogle": (125, 0.128),
}
NQ_TEST_ROWS = 3610  # the recipe's nq_test file: NQ's test set, of which the recipe grades the first 3,000
WEEK_OVERRIDES = ("--save", "--eval-prompt-data paths", "--recipe-flags (extra flags, appended)")


@dataclass(frozen=True)
class Timing:
    """Seconds on the world's clock (ranges are drawn uniformly per occurrence)."""

    rollout_s: tuple[float, float]  # one step's rollout: generation, searches, rewards
    train_s: tuple[float, float]  # the old log-probs, the reference's, the optimizer step
    push_s: float  # one weight push to the engines
    save_bytes_per_s: float  # writing a checkpoint
    eval_s_per_question: tuple[float, float]  # one evaluation's rate (drawn per evaluation)
    eval_load_s: float  # an evaluator loading a version's weights (beside training)
    handover_s: float  # the actor writing a version's HF weights for the evaluator (beside training)
    engine_restart_s: float  # an engine started again until it answers
    driver_restart_s: float  # a scheduler restarting a killed driver, and the run starting up again
    operator_s: float  # a person acting on a stop (reading it, fixing the cause, starting the run again)


@dataclass(frozen=True)
class WorldShape:
    name: str
    timing: Timing
    reward_level: float
    em_level: float
    start: float  # reward and EM at step 0
    rise_steps: float  # the curves' time constant, in healthy updates
    prompt_spread: float  # sd of a prompt's success log-odds around the policy's: the reward's per-step noise
    resample: float  # share of the questions' latent difficulty drawn anew per evaluation (guard_shapes)
    samples_kept: int  # TrainSamples the world hands over per step (the health signals' sample of the batch)
    response_tokens: int
    default_faults: tuple[str, ...]
    disk_bytes: int  # the --save disk's size (other users' files are the full-disk fault)

    def curve(self, level: float, progress: float) -> float:
        """The healthy learning curve: from `start` to `level`, saturating (guard_shapes.healthy)."""
        if self.name == "recipe":
            return healthy(CURVES["recipe"], level, progress)
        return level - (level - self.start) * math.exp(-progress / self.rise_steps)


RECIPE_FAULTS = (
    "retriever_outage",
    "reward_timeout",
    "engine_death",
    "stale_engine",
    "wrong_engine",
    "lr_spike",
    "slow_collapse",
    "fast_collapse",
    "disk_full",
    "driver_kill",
    "eval_hang",
)
MINIATURE_FAULTS = ("nan_rewards", "stale_engine", "lr_spike", "retriever_outage")

SHAPES = {
    # the recipe's curves are guard_shapes' (reward 0.1 -> 0.4, EM 0.1 -> 0.42, time constant 100 steps); a step is
    # 60-120 s (rollout 40-80 s of 256 trajectories with up to 2 searches, 20-40 s of training at TP 2 x DP 2); an
    # evaluation grades 0.024-0.104 s a question (the seven sets whole in 1,240-5,400 s, eval.md's measured range)
    "recipe": WorldShape(
        name="recipe",
        timing=Timing(
            rollout_s=(40.0, 80.0),
            train_s=(20.0, 40.0),
            push_s=5.0,
            save_bytes_per_s=1.5e9,
            eval_s_per_question=(0.024, 0.104),
            eval_load_s=60.0,
            handover_s=15.0,
            engine_restart_s=150.0,
            driver_restart_s=600.0,
            operator_s=7200.0,
        ),
        reward_level=CURVES["recipe"].reward_level,
        em_level=CURVES["recipe"].em_level,
        start=CURVES["recipe"].start,
        rise_steps=CURVES["recipe"].rise_steps,
        prompt_spread=1.0,
        resample=0.3,
        samples_kept=16,
        response_tokens=8,
        default_faults=RECIPE_FAULTS,
        disk_bytes=4 * 10**12,
    ),
    # the miniature week's curve as before (0.3 -> 0.8, time constant 60 steps), its steps ~1.2 s as the CPU main
    # job's (docs/benchmarks/engine_faults.md), 64 questions in a fraction of a second
    "miniature": WorldShape(
        name="miniature",
        timing=Timing(
            rollout_s=(0.3, 0.6),
            train_s=(0.6, 1.0),
            push_s=0.05,
            save_bytes_per_s=0.5e9,
            eval_s_per_question=(0.005, 0.02),
            eval_load_s=1.0,
            handover_s=0.2,
            engine_restart_s=3.0,
            driver_restart_s=30.0,
            operator_s=600.0,
        ),
        reward_level=0.8,
        em_level=0.8,
        start=0.3,
        rise_steps=60.0,
        prompt_spread=1.0,
        resample=0.3,
        samples_kept=8,
        response_tokens=5,
        default_faults=MINIATURE_FAULTS,
        disk_bytes=100 * 10**9,
    ),
}


def write_rows(path: Path, rows: int) -> Path:
    """A placeholder eval set of `rows` rows (only its row count is read: the world grades the questions)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        pq.write_table(pa.table({"index": list(range(rows))}), path)
    return path


def recipe_command(work: Path, run_dir: Path, eval_beside: bool, extra: list[str], steps: int | None) -> list[str]:
    """The recipe's training flags (NUM_ROLLOUT=`steps`: the script's own knob) with the week's overrides: --save,
    the eval sets' paths, `extra` appended."""
    from benchmarks.harness.recipe import GPU_MODEL, recipe_flags

    flags = recipe_flags(GPU_MODEL, {"NUM_ROLLOUT": str(steps)} if steps else None)
    at = flags.index("--eval-prompt-data")
    name, path = flags[at + 1], flags[at + 2]
    if eval_beside:
        sets = [str(x) for n, (rows, _) in SEARCH_R1_SETS.items() for x in (n, write_rows(work / f"{n}.parquet", rows))]
        flags[at : at + 3] = ["--eval-engine", "--eval-prompt-data", *sets]
    else:
        file, _, rows = path.partition("@")
        placeholder = write_rows(work / Path(file).name, NQ_TEST_ROWS)
        flags[at + 1 : at + 3] = [name, f"{placeholder}@{rows}" if rows else str(placeholder)]
    flags[flags.index("--save") + 1] = str(run_dir)
    return flags + list(extra)


def miniature_command(work: Path, run_dir: Path, extra: list[str], steps: int | None) -> list[str]:
    """The miniature week's flags (the tiny Qwen2's model flags, then the week's settings)."""
    from benchmarks.harness.recipe import CPU_MODEL, model_flags

    heldout = write_rows(work / "heldout.parquet", 64)
    return [
        *model_flags(CPU_MODEL),
        *("--hf-checkpoint", "tiny-policy", "--load", "tiny-policy/sft", "--save", str(run_dir)),
        *("--prompt-data", "train.parquet", "--num-rollout", str(steps or 300)),
        *("--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64"),
        *("--advantage-estimator", "grpo", "--use-tis", "--eps-clip", "0.2", "--eps-clip-high", "0.28"),
        *("--eval-prompt-data", "heldout", str(heldout), "--eval-interval", "10", "--save-interval", "10"),
        *(
            "--keep-checkpoints",
            "2",
            "--max-reward-error-rate",
            "0.25",
            "--search-url",
            "http://127.0.0.1:8000/retrieve",
        ),
        *extra,
    ]


@dataclass(frozen=True)
class WeekSetup:
    shape: WorldShape
    argv: list[str]  # the command line the run is started (and resumed) with
    config: object  # RunConfig
    layout: object  # CheckpointLayout of the actor at the run's layout
    eval_sizes: dict[str, int]  # questions graded per set, as the product counts them
    engines: int


def setup(
    shape_name: str,
    work: Path,
    run_dir: Path,
    eval_beside: bool = False,
    extra: list[str] | None = None,
    steps: int | None = None,
) -> WeekSetup:
    """The run's flags, parsed and built into its RunConfig as train.py does, the checkpoint layout of its actor."""
    from megatron_bridge.qwen import pad_vocab_size
    from slime_search.arguments import parse_args
    from slime_search.backends.megatron.checkpoint_size import layout_of_shape
    from slime_search.backends.megatron.model_args import model_from_args
    from slime_search.rollout.manager import evaluation_sizes
    from slime_search.run.config import run_config

    shape = SHAPES[shape_name]
    if shape_name == "recipe":
        argv = recipe_command(work, run_dir, eval_beside, extra or [], steps)
    else:
        if eval_beside:
            raise ValueError("--eval-beside is the recipe's variant; the miniature evaluates inside the step")
        argv = miniature_command(work, run_dir, extra or [], steps)
    args = parse_args(argv)
    model, options = model_from_args(args)
    tp = args.tensor_model_parallel_size
    padded = pad_vocab_size(model.vocab_size, options.make_vocab_size_divisible_by, tp)
    layout = layout_of_shape(model, padded, tp_size=tp, param_bytes=2 if args.bf16 else 4)
    config = run_config(args, model.vocab_size, use_gpu=shape_name == "recipe")
    engines_config = config.rollout.engines
    engines = engines_config.num_gpus // engines_config.gpus_per_engine if engines_config.num_gpus else None
    engines = engines or engines_config.cpu_engines
    sizes = evaluation_sizes(config.rollout.eval_sets, config.rollout.eval_subset)
    return WeekSetup(shape, argv, config, layout, sizes, engines)


def set_level(name: str) -> float:
    """A set's EM relative to NQ's (the held-out curve is NQ's); 1 for a set Search-R1 does not have."""
    for key, (_, level) in SEARCH_R1_SETS.items():
        if name.startswith(key):
            return level / SEARCH_R1_SETS["nq"][1]
    return 1.0
