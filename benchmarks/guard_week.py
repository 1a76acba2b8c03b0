"""A week of training in miniature: the guard left alone for hundreds of steps, with faults injected at random steps.

    python -m benchmarks.guard_week --steps 300 --seeds 0 1 2 [--json out.json]

The real driver loop (slime_search.train.run_steps), guard, recovery and run folder run over a simulated actor, engines
and evaluation (`World`: no model). The world's weights are a point on a healthy learning curve, or broken; each step
answers with the numbers a healthy or faulty step shows (reward, entropy, gradient norm, update KL, the trainer-engine
log-prob gap, search failures, NaN rewards). Checkpoints are folders that hold the world's weights, so a rollback
really restores them; a held-out evaluation grades 64 questions from the served weights' accuracy. Faults, each once,
at a random step (the right action in brackets):

    nan_rewards       3 steps with 10% of the rewards NaN           [warn: reward_errors; the samples are left out]
    stale_engine      the engines keep serving old weights until pushed again (a lost update)   [repush, no rollback]
    lr_spike          one update 100x too large breaks the policy   [rollback: policy_jump]
    retriever_outage  2 steps with every search failing             [skip: search_failures]

Counted: faults acted on with the right action; the guard's actions outside every fault's window (false alarms, warnings
included); checkpoints lost (saved, and neither on disk nor pruned by --keep-checkpoints); the most checkpoints on disk
at once (the run's and those set aside), against the budget the README documents.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ENGINE = ("logprob_gap", "is_weight_tail")
FAULTS = {  # kind -> (steps it lasts, the answers it calls for, the events it may also cause, steps after it)
    "nan_rewards": (3, {("warn", "reward_errors")}, set(), 0),
    "stale_engine": (1, {("repush", ENGINE)}, {("warn", ENGINE)}, 4),
    "lr_spike": (1, {("rollback", "policy_jump")}, {("warn", "entropy_collapse")}, 0),
    "retriever_outage": (2, {("skip", "search_failures")}, set(), 0),
}


def matches(event: tuple[str, str], answers: set) -> bool:
    """Whether (action, rule) is one of `answers` (a rule may be a tuple of rules that answer alike)."""
    return any(
        event[0] == action and event[1] in (rule if isinstance(rule, tuple) else (rule,)) for action, rule in answers
    )


QUESTIONS = 64


@dataclass(frozen=True)
class Weights:
    progress: float = 0.0  # healthy updates the weights embody
    broken: bool = False

    def accuracy(self) -> float:
        return 0.05 if self.broken else 0.3 + 0.5 * (1 - math.exp(-self.progress / 60))


class World:
    """The actor's weights, what the engines serve, and the faults still to come (each fires once, by step)."""

    def __init__(self, rng, faults: dict[str, int]):
        self.rng = rng
        self.trained = Weights()
        self.served = Weights()
        self.faults = dict(faults)  # kind -> first step
        self.stale = False
        self.last_push: str | None = None
        self.difficulty = rng.random(QUESTIONS)  # a question is answered when its difficulty is below the accuracy

    def active(self, kind: str, step: int) -> bool:
        start = self.faults.get(kind)
        return start is not None and start <= step < start + FAULTS[kind][0]

    def fired(self, kind: str, step: int) -> None:
        if self.faults.get(kind) is not None and step >= self.faults[kind] + FAULTS[kind][0] - 1:
            self.faults[kind] = None  # done: a redone step after a rollback does not meet it again


class LocalActor:
    """A Ray actor's calling convention (`obj.method.remote(...)` -> an object ref) over a plain object."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        import ray

        method = getattr(self._target, name)
        return SimpleNamespace(remote=lambda *a, **k: ray.put(method(*a, **k)))


class SimManager:
    def __init__(self, world: World):
        self.world, self.step, self.attempt = world, 0, 0

    def generate(self, examples: int):
        from slime_search.rollout.manager import RolloutBatch
        from slime_search.types import TrainSample

        w, step, rng = self.world, self.step, self.world.rng
        self.step += 1
        gap = 1.5 if w.stale else 0.0
        samples = [
            TrainSample(list(range(10)), 5, [1] * 5, rollout_log_probs=[-1.0 - gap] * 5, token_versions=[step] * 5)
            for _ in range(8)
        ]
        errors, metrics = (
            {},
            {
                "rollout/samples": 64.0,
                "rollout/trainable": 64.0,
                "rollout/reward_mean": w.served.accuracy() + rng.normal(0, 0.03),
                "rollout/response_length_p90": 100.0 + rng.normal(0, 8),
                "rollout/truncation_rate": 0.1,
                "rollout/zero_std_group_share": 0.3,
                "rollout/search_calls": 100.0,
                "rollout/search_failures": 0.0,
                "rollout/reward_errors": 0.0,
            },
        )
        if w.active("nan_rewards", step):
            metrics["rollout/reward_errors"], errors["reward_error"] = 6.0, "reward plugin returned nan"
            w.fired("nan_rewards", step)
        if w.active("retriever_outage", step):
            metrics["rollout/search_failures"], errors["search_error"] = 100.0, "retriever: connection refused"
            w.fired("retriever_outage", step)
        return RolloutBatch(samples, metrics, [], errors)

    def progress(self):
        return 1, 1

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def set_sampling_attempt(self, attempt: int):
        self.attempt = attempt  # the simulated rollouts draw from the world's own generator


class SimGroup:
    def __init__(self, world: World, manager: SimManager):
        self.world, self.manager, self.lr_scale = world, manager, 1.0

    def prepare(self, samples) -> None:
        for sample in samples:
            sample.old_log_probs = [-1.0] * sample.response_length  # the trainer's own weights

    def optimize(self, samples, steps: int, skip_above: float | None = None) -> dict[str, float]:
        w, step = self.world, self.manager.step - 1
        norm = float(0.5 * math.exp(w.rng.normal(0, 0.2)))
        applied = skip_above is None or norm <= skip_above
        spike = w.active("lr_spike", step)
        if applied:
            w.trained = Weights(w.trained.progress + self.lr_scale, broken=w.trained.broken or spike)
        if spike:
            w.fired("lr_spike", step)
        return {
            "train/loss": 0.1,
            "train/grad_norm": norm,
            "train/grad_norm_max": norm,
            "train/steps": 1.0,
            "train/steps_applied": float(applied),
            "train/entropy": 0.01 if w.trained.broken else 1.0 + w.rng.normal(0, 0.05),
            "train/kl_old_new": 5.0 if spike and applied else 0.01,
            "train/lr": 1e-3 * self.lr_scale,
        }

    def save(self, root: str, steps_done: int, files: dict[str, str]) -> None:
        from slime_search.backends.megatron.checkpoint import TRACKER, iteration_dir

        folder = iteration_dir(root, steps_done)
        folder.mkdir(parents=True)
        (folder / "weights.json").write_text(json.dumps(vars(self.world.trained)))
        for name, text in files.items():
            (folder / name).write_text(text)
        (Path(root) / TRACKER).write_text(str(steps_done))
        self.world.saved += 1

    def load(self, root: str, steps_done: int) -> None:
        from slime_search.backends.megatron.checkpoint import iteration_dir

        self.world.trained = Weights(**json.loads((iteration_dir(root, steps_done) / "weights.json").read_text()))

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale

    def shutdown(self) -> None:
        """Nothing runs."""


class SimPush:
    """The weight push: the engines serve the trainer's weights, except while an update is lost (stale_engine); a
    push of the same version again (the guard's re-push) reconnects and delivers it."""

    def __init__(self, world: World, manager: SimManager):
        self.world, self.manager = world, manager

    def push(self, version: str) -> str:
        w, step = self.world, self.manager.step - 1
        if w.active("stale_engine", step):
            w.stale = True
            w.fired("stale_engine", step)
        if version == w.last_push:
            w.stale = False
        if not w.stale:
            w.served = w.trained
        w.last_push = version
        return version


class SimEval:
    """Greedy evaluation of the served weights on QUESTIONS fixed questions, with per-question grades."""

    manager = None

    def __init__(self, handles, world: World):
        self.h, self.world = handles, world

    def results(self, step: int):
        from slime_search.eval_beside import EvalResult
        from slime_search.rollout.evaluation import GRADES

        if not self.h.config.eval_due(step):
            return []
        w = self.world
        noise = w.rng.normal(0, 0.1, QUESTIONS)
        grades = [float(d < w.served.accuracy() + n) for d, n in zip(w.difficulty, noise, strict=True)]
        return [EvalResult(step, {"eval/score": sum(grades) / QUESTIONS, GRADES: grades}, [], {"time/eval_s": 0.0})]

    def pending_versions(self) -> set[int]:
        return set()  # evaluated inside the step

    def metrics(self) -> dict[str, float]:
        return {}

    def rolled_back(self, to_step: int) -> None:
        pass


def run_config(args, run_dir: Path):
    from slime_search.evaluation.subsets import EvalSubset
    from slime_search.health.config import HealthConfig
    from slime_search.rollout.schedule import ScheduleConfig
    from slime_search.run_config import RunConfig

    loss = SimpleNamespace(uses_old_log_probs=True, tis_cap=2.0, mis=None)
    return RunConfig(
        run_dir=str(run_dir),
        num_rollout=args.steps,
        save_interval=args.save_interval,
        keep_checkpoints=args.keep,
        save_hf=False,
        eval_interval=args.eval_interval,
        log_rollout_examples=0,
        colocate=False,
        serves_policy=True,
        steps_per_rollout=1,
        train_group=None,
        model=SimpleNamespace(load=None),
        actor=SimpleNamespace(loss=loss),
        rollout=SimpleNamespace(  # the simulated evaluations grade every question: nothing is left to confirm on
            eval_sets=["heldout"], eval_subset=EvalSubset(), rollout=SimpleNamespace(reward_key="score")
        ),
        weight_sync=None,
        schedule=ScheduleConfig("off"),
        wandb=(False, "", None),
        health=HealthConfig(max_reward_error_rate=0.25),
    )


def week(args, seed: int, work: Path) -> dict:
    """One simulated run; its faults at random steps, apart from each other and from the start."""
    import numpy as np

    from slime_search.health.guard import RunStopped
    from slime_search.health.recovery import Recovery
    from slime_search.metrics import MetricsSink
    from slime_search.ray.colocation import Colocation
    from slime_search.run_folder import RunFolder
    from slime_search.run_handles import RunHandles
    from slime_search.train import run_steps

    rng = np.random.default_rng(seed)
    slots = rng.choice(np.arange(2, args.steps // 20), size=len(FAULTS), replace=False) * 20 + rng.integers(0, 10)
    faults = {kind: int(at) for kind, at in zip(FAULTS, sorted(slots), strict=True)}
    world = World(rng, faults)
    world.saved = 0
    config = run_config(args, work / f"seed{seed}")
    run = RunFolder(config.run_dir)
    peak, pruned = [0], [0]
    prune, prune_undone = run.prune_checkpoints, run._prune_undone

    def counted_prune(keep, protect=()):
        removed = prune(keep, protect)
        pruned[0] += len(removed)
        peak[0] = max(peak[0], len(run.checkpoint_steps()) + len(run.undone_checkpoints()))
        return removed

    def counted_undone(keep):
        n = prune_undone(keep)
        pruned[0] += n
        return n

    run.prune_checkpoints, run._prune_undone = counted_prune, counted_undone
    manager = SimManager(world)
    remote = LocalActor(manager)
    group = SimGroup(world, manager)
    from slime_search.health.guard import HealthGuard

    h = RunHandles(
        config, run, MetricsSink(run.path), group, HealthGuard(config.health), remote, SimPush(world, manager)
    )
    h.colocation, h.evaluator = Colocation(False, group, remote), SimEval(h, world)
    h.restart_down_engines = lambda: []
    stopped = None
    try:
        run_steps(h, Recovery(h), 0)
    except RunStopped as err:
        stopped = str(err)
    h.sink.close()
    result = judge(faults, run.events(), world.saved, run, pruned[0], peak[0], stopped, config)
    result["sampling_attempt"] = manager.attempt  # the recovery's word to the rollouts: one more per rollback
    return result


def classify(faults: dict[str, int], events: list[dict]) -> tuple[dict[str, list], list[tuple]]:
    """The guard's events by the fault whose window they fall in and answer; the others, as (step, action, rule)."""
    windows = {kind: (at, at + FAULTS[kind][0] - 1 + FAULTS[kind][3]) for kind, at in faults.items()}
    acted = {kind: [] for kind in faults}
    outside = []
    for e in events:
        if e["action"] == "resume" or "to_step" in e.get("values", {}):
            continue  # a rollback's completion repeats its decision
        event = (e["action"], e["rule"])
        kind = next((k for k, (a, b) in windows.items() if a <= e["step"] <= b), None)
        if kind is None or not matches(event, FAULTS[kind][1] | FAULTS[kind][2]):
            outside.append((e["step"], *event))
        else:
            acted[kind].append(event)
    return acted, outside


def answered(faults: dict[str, int], acted: dict[str, list]) -> dict[str, bool]:
    """Whether every answer each fault calls for was given (anything harsher counts outside)."""
    return {kind: all(any(matches(a, {want}) for a in acted[kind]) for want in FAULTS[kind][1]) for kind in faults}


def judge(faults, events, saved, run, pruned, peak, stopped, config) -> dict:
    acted, outside = classify(faults, events)
    right = answered(faults, acted)
    present = len(run.checkpoint_steps()) + len(run.undone_checkpoints())
    return {
        "faults": faults,
        "right_action": right,
        "outside_windows": outside,
        "checkpoints_saved": saved,
        "checkpoints_lost": saved - present - pruned,
        "peak_on_disk": peak,
        "budget": 2 * config.keep_checkpoints + 4,
        "stopped": stopped,
        "final": json.loads((run.path / "final.json").read_text()) if (run.path / "final.json").is_file() else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="--keep-checkpoints")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 100:
        parser.error("--steps must be >= 100: the faults are spread 20 steps apart from step 40")
    import logging

    import ray

    logging.basicConfig(level=logging.ERROR)
    started = not ray.is_initialized()  # a caller's Ray (a test session's) is used as it is
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results = []
    with tempfile.TemporaryDirectory(prefix="guard-week-") as work:
        for seed in args.seeds:
            results.append({"seed": seed, **week(args, seed, Path(work))})
            print(json.dumps(results[-1]), flush=True)
    if started:
        ray.shutdown()
    print(
        "| seed | faults (step) | right action | actions outside the faults | lost | peak on disk (budget) | stopped |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        faults = ", ".join(f"{k} ({v})" for k, v in r["faults"].items())
        right = f"{sum(r['right_action'].values())} of {len(r['right_action'])}"
        print(
            f"| {r['seed']} | {faults} | {right} | {len(r['outside_windows'])} | {r['checkpoints_lost']} | "
            f"{r['peak_on_disk']} ({r['budget']}) | {'yes' if r['stopped'] else 'no'} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
