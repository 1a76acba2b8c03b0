"""What the run's parts must answer, as the loop, the recovery and the evaluators call them.

Each part has one product implementation and one in the simulated week (benchmarks/studies/guard_week): the Megatron
actor's group (RayTrainGroup; SimGroup), the weight transport (weight_sync; SimPush), the rollout schedule
(rollout.schedule), the held-out evaluator (run.evaluators) and the clock (utils.clock; the world's clock). The rollout
manager is a Ray actor: its methods are called as `manager.method.remote(...)` and return object refs (RemoteManager).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ray import ObjectRef

    from slime_search.run.eval_engine import EvalResult
    from slime_search.types import TrainSample


class Clock(Protocol):
    """What the run's waits go through: a simulation runs an hour-long outage in no time."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RemoteMethod(Protocol):
    def remote(self, *args: object, **kwargs: object) -> ObjectRef: ...


class RemoteManager(Protocol):
    """A Ray actor handle of the RolloutManager (rollout.manager): every attribute is a remote method."""

    def __getattr__(self, name: str) -> RemoteMethod: ...


class TrainGroup(Protocol):
    """The actor's ranks, driven together, as the loop and the recovery use them (run.parts.open_parts loads the
    models of the product's RayTrainGroup)."""

    def prepare(self, samples: list[TrainSample]) -> None: ...

    def optimize(self, samples: list[TrainSample], steps: int, skip_above: float | None = None) -> dict[str, float]: ...

    def trainer_log_probs(self, token_ids: list[int]) -> list[float]: ...

    def save(self, root: str, iteration: int, extra_files: dict[str, str] | None = None) -> None: ...

    def load(self, root: str, iteration: int | None = None) -> int | None: ...

    def on_all_ranks(self, method: str, *args: object) -> list[object]: ...

    def set_lr_scale(self, scale: float) -> None: ...

    def shutdown(self) -> None: ...


class WeightPush(Protocol):
    """The actor's weights to the engines; `push` returns the version the engines then serve."""

    def connect(self) -> None: ...

    def push(self, version: str) -> str: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...


class RolloutSchedule(Protocol):
    """When rollouts run relative to training (--async-mode)."""

    def start(self, policy_version: int) -> None: ...

    def next_batch(self, step: int, examples: int) -> object: ...

    def weight_push(self) -> AbstractContextManager[None]: ...

    def pushed(self, policy_version: int) -> None: ...

    def stop(self) -> None: ...


class Evaluator(Protocol):
    """Held-out evaluation as the loop sees it: inside the step or beside training (run.evaluators)."""

    def results(self, step: int) -> Iterable[EvalResult]: ...

    def pending_versions(self) -> set[int]: ...

    def metrics(self) -> dict[str, float]: ...

    def rolled_back(self, to_step: int) -> None: ...


class EvaluationsBeside(Protocol):
    """The evaluator's engine beside training, from the driver's side (run.eval_engine.EvalEngine)."""

    def submit(self, version: int) -> float: ...

    def collect(self, wait: bool = False) -> list[EvalResult]: ...

    def pending_versions(self) -> set[int]: ...

    def metrics(self) -> dict[str, float]: ...

    def rolled_back(self, to_step: int) -> None: ...
