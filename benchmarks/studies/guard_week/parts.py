"""The run's parts over the simulated world, with the interfaces the driver, the recovery and the guard call. They are
the rollout manager and its engines (SimManager, behind a Ray actor's calling convention), the actor's group (SimGroup)
and the weight transport (SimPush). The evaluator beside training is SimEvalBeside: EvalEngine's contract on the world's
clock. Each step's time passes on the world's clock as its parts run; the faults act where they would.
"""

from __future__ import annotations

import errno
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from benchmarks.studies.guard_week.world import COLLAPSES, DriverKilled, Weights, World, logit

WRONG_NATS = 1.5  # how far off an engine that serves other weights (or computes wrongly) is, per token
TRAINER_LOG_PROB = -1.0  # the trainer's log-prob of every generated token (the engines agree to NUMERIC_SD)
NUMERIC_SD = 0.01  # bf16 engines against a bf16 trainer: ~0.005-0.01 per token (run.engine_check)
SEARCHES_PER_SAMPLE = (1.2, 1.8)
WEIGHTS_FILE = "weights.json"


class LocalActor:
    """A Ray actor's calling convention (`obj.method.remote(...)` -> an object ref) over a plain object."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        import ray

        method = getattr(self._target, name)
        return SimpleNamespace(remote=lambda *a, **k: ray.put(method(*a, **k)))


@dataclass
class Engine:
    url: str
    served: Weights = field(default_factory=Weights)  # a fresh engine serves the weights it started from
    alive: bool = True
    ready_at: float | None = None  # restarting: answers from then on
    connected: bool = True  # to the weight transport (a restarted engine after RunParts.engines_back)
    stuck: bool = False  # its weight updates are lost until the same version is pushed again


class SimManager:
    """The RolloutManager: engines, rollouts, the evaluation inside the step."""

    def __init__(self, world: World):
        self.world = world
        self.engines = [Engine(url) for url in world.urls]
        self.step = 0  # the version pushed last: the step the next rollout is for
        self.group = None  # SimGroup: what the trainer holds (the engines agree when they serve it)
        self.attempt = 0
        self.restarted: list[Engine] = []  # engines restarted after they died: do they serve the next push?

    def offset(self, engine: Engine) -> float:
        """How far the engine's log-probs are from the trainer's, per token."""
        wrong = engine.url in self.world.bad_hardware or engine.served != self.group.weights
        return WRONG_NATS if wrong else 0.0

    def generate(self, examples: int = 0):
        from slime_search.rollout.manager import RolloutBatch

        step = self.step
        start, end = self.rollout_time(step)
        live = self.live_engines(step)
        metrics, errors = self.rollout_metrics(step, start, end, live)
        return RolloutBatch(self.samples(live, step), metrics, [], errors)

    def rollout_time(self, step: int) -> tuple[float, float]:
        """The rollout's span on the clock (which it advances), and the faults that meet it there: the driver killed
        mid-rollout, an outage or a reward service's timeouts beginning, an engine dying or going wrong."""
        w, rng, clock = self.world, self.world.rng, self.world.clock
        start, seconds = clock.now(), w.draw(w.shape.timing.rollout_s)
        if w.due("driver_kill", step):
            clock.sleep(seconds * rng.random())
            raise DriverKilled(f"SIGKILL during the rollout of step {step}")
        for kind in ("retriever_outage", "reward_timeout"):
            if w.due(kind, step):
                w.begin_span(kind, start + seconds * rng.random() / 2)
        seconds *= 1.0 - 0.5 * w.share("retriever_outage", start, start + seconds)  # failing searches fail fast
        if w.due("engine_death", step):
            self.engines[0].alive = False  # mid-rollout: its turns fail over to the others
        if w.due("wrong_engine", step):
            w.bad_hardware.add(self.engines[-1].url)
            w.facts.bad_engine = self.engines[-1].url
        clock.advance_to(start + seconds)
        return start, start + seconds

    def live_engines(self, step: int) -> list[Engine]:
        """The engines that answer; an engine restarted after it died is checked to serve the push it took."""
        for engine in self.restarted:
            self.world.facts.served_after_restart.append((step, engine.alive and self.offset(engine) == 0.0))
        self.restarted = []
        return [e for e in self.engines if e.alive] or self.engines

    def rollout_metrics(self, step: int, start: float, end: float, live: list[Engine]):
        """The rollout's record and first errors, as the real rollout reports them. The rewards are of 32 x 8 samples,
        each prompt's chance the policy's log-odds plus its own difficulty. Searches fail for the share of the rollout
        the retriever was down. Rewards fail (a transient kind) for the share the reward service timed out."""
        import numpy as np

        w, rng = self.world, self.world.rng
        search_down, rewards_down = w.share("retriever_outage", start, end), w.share("reward_timeout", start, end)
        for kind, share in (("retriever_outage", search_down), ("reward_timeout", rewards_down)):
            if share:
                w.met(kind, step)
        config = w.config.rollout.rollout
        prompts, per_prompt = config.batch_size, config.n_samples_per_prompt
        odds = logit(sum(w.reward_accuracy(e.served) for e in live) / len(live))
        chance = 1 / (1 + np.exp(-(odds + rng.normal(0.0, w.shape.prompt_spread, prompts))))
        rewards = (rng.random((prompts, per_prompt)) < chance[:, None]).astype(float)
        samples_n, errors = prompts * per_prompt, {}
        failed_rewards = int(round(samples_n * rewards_down))
        nan_rewards = int(round(0.1 * samples_n)) if self.nan_rewards(step) else 0
        if failed_rewards:
            errors["reward_error_transient"] = (
                f"reward plugin reward_func raised on sample {int(rng.integers(samples_n))}: TimeoutError: the reward "
                "service did not answer within 30 s"
            )
        if nan_rewards:
            errors["reward_error"] = "reward plugin returned nan"
        calls = float(round(samples_n * w.draw(SEARCHES_PER_SAMPLE)))
        failures = float(round(calls * search_down))
        if failures:
            errors["search_error"] = "retriever http://127.0.0.1:8000/retrieve: connection refused"
        bad = min(samples_n, failed_rewards + nan_rewards)
        kept = rewards.reshape(-1)[bad:]
        metrics = {
            "rollout/samples": float(samples_n),
            "rollout/trainable": float(samples_n - bad),
            "rollout/reward_mean": float(kept.mean()) if kept.size else 0.0,
            "rollout/reward_std": float(kept.std()) if kept.size else 0.0,
            "rollout/response_length_p90": 400.0 + rng.normal(0, 20),
            "rollout/truncation_rate": 0.05,
            "rollout/zero_std_group_share": float((rewards.min(axis=1) == rewards.max(axis=1)).mean()),
            "rollout/search_calls": calls,
            "rollout/search_failures": failures,
            "rollout/reward_errors": float(bad),
            "rollout/reward_errors_transient": float(failed_rewards),
        }
        return metrics, errors

    def nan_rewards(self, step: int) -> bool:
        """The miniature's reward plugin returning NaN for a tenth of the samples, the 3 steps from its step (each
        once: redone steps draw other prompts)."""
        at, met = self.world.faults.get("nan_rewards"), self.world.facts.met.get("nan_rewards", [])
        if at is None or not at <= step < at + 3 or step in met:
            return False
        self.world.fired.add("nan_rewards")
        self.world.met("nan_rewards", step)
        return True

    def samples(self, live: list[Engine], step: int):
        from slime_search.types import TrainSample

        w, n = self.world, self.world.shape.response_tokens
        out = []
        for i in range(w.shape.samples_kept):
            engine = live[i % len(live)]
            logprobs = TRAINER_LOG_PROB - self.offset(engine) + w.rng.normal(0.0, NUMERIC_SD, n)
            out.append(TrainSample(list(range(2 * n)), n, [1] * n, rollout_log_probs=logprobs.tolist(),
                                   token_versions=[step] * n))  # fmt: skip
        return out

    def evaluate(self, examples: int = 0, subset=None):
        """The evaluation inside the step (on the rollout engines), or of `subset`'s questions (the end's
        confirmation on questions the evaluations left out); an evaluation that hangs has no result within the
        product's deadline, which the world's clock passes."""
        from slime_search.rollout.manager import evaluation_sizes
        from slime_search.run.evaluators import eval_deadline

        w, live = self.world, [e for e in self.engines if e.alive] or self.engines
        if subset is None and w.due("eval_hang", self.step):
            deadline_s, questions = eval_deadline(w.config)
            w.clock.sleep(deadline_s)
            w.facts.eval_blind_s += deadline_s
            raise TimeoutError(f"the evaluation of version {self.step} ({questions} questions) had no result within "
                               f"{deadline_s:.0f} s (--eval-timeout): it hung")  # fmt: skip
        sizes = None if subset is None else evaluation_sizes(w.config.rollout.eval_sets, subset)
        w.clock.sleep(w.eval_seconds(sum((sizes or w.week.eval_sizes).values()), load=False))
        return w.grade(live[0].served, sizes, fresh=subset is not None), []

    def engine_log_probs(self, token_ids: list[int]) -> dict[str, list[float]]:
        n = len(token_ids) - 1
        rng = self.world.rng
        return {
            e.url: (TRAINER_LOG_PROB - self.offset(e) + rng.normal(0, NUMERIC_SD, n)).tolist() for e in self.engines
        }

    def restart_engine(self, url: str) -> None:
        engine = next(e for e in self.engines if e.url == url)
        self._restart(engine)

    def _restart(self, engine: Engine) -> None:
        engine.alive, engine.connected, engine.stuck = False, False, False
        engine.served = Weights()  # it starts from the HF checkpoint
        engine.ready_at = self.world.clock.now() + self.world.shape.timing.engine_restart_s

    def restart_down_engines(self) -> list[str]:
        down = [e for e in self.engines if not e.alive and e.ready_at is None]
        for engine in down:
            self._restart(engine)
            self.world.note(self.step, "engine_restart", "engine_down")
        self.restarted += down
        return [e.url for e in down]

    def wait_restarted_engines(self) -> list[str]:
        back = [e for e in self.engines if e.ready_at is not None]
        for engine in back:
            self.world.clock.advance_to(engine.ready_at)
            engine.alive, engine.ready_at = True, None
        return [e.url for e in back]

    def pause_generation(self, urls=None) -> None:
        """Nothing generates between the steps of a synchronous run."""

    def continue_generation(self, urls=None) -> None:
        """As pause_generation."""

    def worker_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def progress(self):
        return 1, 1

    def state_dict(self):
        return {"data": {}}

    def load_state_dict(self, state) -> None:
        """The world's prompts have no position."""

    def set_sampling_attempt(self, attempt: int) -> None:
        self.attempt = attempt

    def on_all_ranks(self, method: str, *args) -> list:
        raise NotImplementedError(f"the simulated actor has no ranks to run {method} on (the week writes no --save-hf)")

    def shutdown(self) -> None:
        """Nothing runs."""


class SimGroup:
    """The actor's group: its weights, the update, checkpoints (a small file recording the bytes a real one takes)."""

    def __init__(self, world: World, manager: SimManager):
        self.world, self.manager = world, manager
        self.weights = Weights()
        self.lr_scale = 1.0

    def prepare(self, samples) -> None:
        for sample in samples:
            sample.old_log_probs = [TRAINER_LOG_PROB] * sample.response_length

    def optimize(self, samples, steps: int, skip_above: float | None = None) -> dict[str, float]:
        w, step, rng = self.world, self.manager.step, self.world.rng
        w.clock.sleep(w.draw(w.shape.timing.train_s))
        norm = float(0.5 * math.exp(rng.normal(0, 0.2)))
        applied = skip_above is None or norm <= skip_above
        spike = w.due("lr_spike", step)
        if applied:
            self.weights = self.updated(self.weights, step, spike)
        return {
            "train/loss": 0.1,
            "train/grad_norm": norm,
            "train/grad_norm_max": norm,
            "train/steps": 1.0,
            "train/steps_applied": float(applied),
            "train/entropy": 0.01 if self.weights.broken else 1.0 + rng.normal(0, 0.05),
            "train/kl_old_new": 5.0 if spike and applied else 0.01,
            "train/lr": 1e-6 * self.lr_scale,
        }

    def updated(self, weights: Weights, step: int, spike: bool) -> Weights:
        """One applied update: progress at the lr's scale; a collapse that begins, deepens or heals; an lr spike
        breaks the weights."""
        w, collapse, fallen = self.world, weights.collapse, weights.fallen
        for kind in COLLAPSES:
            if collapse is None and w.due(kind, step):
                collapse, fallen = kind, 0.0
                w.collapse_attempt[kind] = self.manager.attempt
        if collapse is not None:
            fallen = fallen + 1.0 if w.deepens(collapse, fallen, self.manager.attempt) else fallen - 1.0
            collapse, fallen = (collapse, fallen) if fallen > 0 else (None, 0.0)
        return Weights(weights.progress + self.lr_scale, weights.broken or spike, collapse, fallen)

    def save(self, root: str, iteration: int, extra_files: dict[str, str] | None = None) -> None:
        from slime_search.backends.megatron.checkpoint import TRACKER, iteration_dir

        steps_done, files = iteration, extra_files or {}

        w = self.world
        if w.due("disk_full", steps_done):
            w.begin_span("disk_full", w.clock.now())
        if w.active("disk_full", w.clock.now()):
            w.met("disk_full", max(0, steps_done - 1))
            raise OSError(errno.ENOSPC, "No space left on device", str(iteration_dir(root, steps_done)))
        size = checkpoint_size(w)
        w.clock.sleep(size / w.shape.timing.save_bytes_per_s)
        folder = iteration_dir(root, steps_done)
        replaced = folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / WEIGHTS_FILE).write_text(json.dumps({"weights": vars(self.weights), "bytes": size}))
        for name, text in files.items():
            (folder / name).write_text(text)
        (Path(root) / TRACKER).write_text(str(steps_done))
        w.facts.saved += 0 if replaced else 1
        w.facts.newest = steps_done
        on_disk, folders = bytes_on_disk(Path(root))
        if on_disk > w.facts.peak_bytes:
            w.facts.peak_bytes, w.facts.peak_folders = on_disk, folders

    def load(self, root: str, iteration: int | None = None) -> None:
        from slime_search.backends.megatron.checkpoint import iteration_dir

        steps_done = iteration

        record = json.loads((iteration_dir(root, steps_done) / WEIGHTS_FILE).read_text())
        self.weights = Weights(**record["weights"])
        self.world.facts.newest_before_load, self.world.facts.newest = self.world.facts.newest, steps_done
        self.world.clock.sleep(record["bytes"] / self.world.shape.timing.save_bytes_per_s)

    def trainer_log_probs(self, token_ids: list[int]) -> list[float]:
        return [TRAINER_LOG_PROB] * (len(token_ids) - 1)

    def checkpoint_layout(self):
        return self.world.week.layout

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale

    def on_all_ranks(self, method: str, *args) -> list:
        raise NotImplementedError(f"the simulated actor has no ranks to run {method} on (the week writes no --save-hf)")

    def shutdown(self) -> None:
        """Nothing runs."""


def checkpoint_size(world: World) -> int:
    from slime_search.backends.megatron.checkpoint_size import checkpoint_bytes

    return checkpoint_bytes(world.week.layout)


def bytes_on_disk(root: Path) -> tuple[int, list[str]]:
    """The bytes the checkpoints under `root` (the run's and those set aside) record, and their folders."""
    folders = [p for p in root.glob("iter_*") if p.is_dir()] + [p for p in root.glob("undone/*/iter_*") if p.is_dir()]
    sizes = {p: json.loads((p / WEIGHTS_FILE).read_text())["bytes"] for p in folders if (p / WEIGHTS_FILE).is_file()}
    return sum(sizes.values()), sorted(str(p.relative_to(root)) for p in sizes)


class SimPush:
    """The weight transport: the live engines connected to it take the trainer's weights. An engine whose update is lost
    (the stale-engine fault) keeps its weights and reports the new version. That lasts until the same version is pushed
    again: the guard's re-push reconnects it."""

    def __init__(self, world: World, manager: SimManager, group: SimGroup):
        self.world, self.manager, self.group = world, manager, group
        self.last: int | None = None

    def connect(self) -> None:
        for engine in self.manager.engines:
            engine.connected = True

    def reconnect(self) -> None:
        for engine in self.manager.engines:
            engine.connected = engine.connected or engine.alive

    def push(self, version: str) -> str:
        w, v = self.world, int(version)
        if w.due("stale_engine", v - 1):
            self.manager.engines[-1].stuck = True
        for engine in self.manager.engines:
            if not engine.alive or not engine.connected:
                continue
            if engine.stuck and v != self.last:
                continue  # lost: it still serves what it had
            engine.stuck, engine.served = False, self.group.weights
        w.clock.sleep(w.shape.timing.push_s)
        self.last = self.manager.step = v
        return version

    def close(self) -> None:
        """Nothing to close."""
