"""A week of training with the health guard left alone, at the 3B recipe's shape or the miniature's, faults injected.

    python -m benchmarks.studies.guard_week --shape recipe --seeds 0 1 2 3 4                 # run_qwen2.5_3B.sh as it is
    python -m benchmarks.studies.guard_week --shape recipe --eval-beside --seeds 0 1 2 3 4   # with --eval-engine, 7 sets
    python -m benchmarks.studies.guard_week --shape miniature --seeds 0 1 2 3 4              # the miniature's week
    python -m benchmarks.studies.guard_week --shape recipe --steps 200 --faults ... --json out.json

The real driver loop (slime_search.run.loop.run_steps), guard, recovery, pruning and run folder run over a simulated
world, with no model and none of the run's Ray actors. The recovery does its re-push, probe, pauses, rollbacks, stops
and resume. The rollout manager and its engines, the actor's group, the weight transport and the evaluator beside
training are the world's (parts.py, beside.py). The evaluation inside the step is the product's InStepEval over the
world's manager. Time is the world's clock (RunParts.clock). Each step's rollout, training, push, save and evaluation
take their time at the shape, and the guard's waits pass on it. So a 10-minute outage is 5-10 of the recipe's 60-120 s
steps, and a week runs in seconds.

The run's configuration is the run's own: the recipe's command line as `DRY_RUN=1 bash
examples/search-r1/run_qwen2.5_3B.sh` prints it (NUM_ROLLOUT=--steps). It is parsed by our parser and built by
run_config, with every default it implies. Those are checkpoints every 20 and at every evaluated version, evaluation
every 25, --keep-checkpoints 2, and every health bound as shipped. Overrides, and only these (shapes.py): --save (a
folder of the week's), the eval sets' paths (placeholder files of the sets' real row counts: nq_test[0:3000] of NQ's
3,610; with --eval-beside, --eval-engine and the seven Search-R1 test sets whole, 51,713 questions, in place of
nq_test), flags given with --recipe-flags; RunParts.checkpoint_bytes is left unset, since the product's check for room
before a save reads this machine's disk. The world's disk fails the save itself (ENOSPC), as a full disk would. The disk
budget is the product's (disk_budget), with the world's disk size in place of this machine's free space.

The world at the recipe's shape (shapes.py, world.py): training reward 0.1 -> 0.4 and held-out EM 0.1 -> 0.42, along the
saturating curve of benchmarks.harness.curves (its recipe shape, from Search-R1's 3B runs). The step's reward is drawn
as 32 prompts x 8 samples, each prompt with its own difficulty (sd ~0.05 a step). Each evaluation is binomial over its
questions, with a latent difficulty per question, 30% drawn anew per evaluation. Each set sits at its level relative to
NQ; two engines; checkpoints of the bytes the actor at TP 2 x DP 2 in bf16 writes (checkpoint_size: 43.2 GB), each saved
as a small file that records them; evaluations at 0.024-0.104 s a question (the seven sets in 1,240-5,400 s: beside
training a lag of tens of steps). The faults, their durations and their right answers: faults.py. The judge: judge.py.

Its figures: `docs/benchmarks/health.md`.
"""

from benchmarks.studies.guard_week.faults import faults_for, matches, place
from benchmarks.studies.guard_week.judge import answered, classify
from benchmarks.studies.guard_week.run import main

__all__ = ["answered", "classify", "faults_for", "main", "matches", "place"]
