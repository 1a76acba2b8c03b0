"""The driver's wing as a newcomer reads it: the run's parts typed (no `Any`), each protocol answered by the product's
part and by the simulated week's, the loop short, every decision reaching it one way, and the parts started and
stopped through one ExitStack (what started is stopped, in reverse, when a later part fails to start)."""

from __future__ import annotations

import ast
import inspect
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime_search.run import protocols

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "slime_search" / "run"


def class_annotations(path: Path, name: str) -> dict[str, str]:
    [node] = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name]
    return {n.target.id: ast.unparse(n.annotation) for n in node.body if isinstance(n, ast.AnnAssign)}


@pytest.mark.parametrize(("module", "name"), [("parts.py", "RunParts"), ("config.py", "RunConfig")])
def test_no_part_of_the_run_is_typed_any(module, name):
    annotations = class_annotations(RUN / module, name)
    assert len(annotations) >= 10  # the class was found, with its fields
    untyped = {field: kind for field, kind in annotations.items() if "Any" in kind or kind == "object"}
    assert untyped == {}


def code_lines(function) -> int:
    """Lines of a function's body, without its docstring, blank lines and comment-only lines."""
    source = inspect.getsource(function)
    body = ast.parse(source).body[0].body
    start = body[1].lineno if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 1
    lines = source.splitlines()[start - 1 :]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_the_loop_is_at_most_twenty_lines():
    from slime_search.run.loop import run_from, run_steps

    assert code_lines(run_steps) + code_lines(run_from) <= 20


def parameters(method) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p != "self"]


def protocol_methods(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def implementations():
    from benchmarks.studies.guard_week.beside import SimEvalBeside
    from benchmarks.studies.guard_week.parts import SimGroup, SimPush
    from benchmarks.studies.guard_week.world import SimClock
    from slime_search.ray.train_group import RayTrainGroup
    from slime_search.rollout.schedule import FullyAsync, OneStepOff, Synchronous
    from slime_search.run.eval_engine import EvalEngine
    from slime_search.run.evaluators import BesideEval, InStepEval
    from slime_search.utils.clock import SystemClock
    from slime_search.weight_sync.transport_base import WeightTransport

    return [
        (protocols.Clock, [SystemClock, SimClock]),
        (protocols.TrainGroup, [RayTrainGroup, SimGroup]),
        (protocols.WeightPush, [WeightTransport, SimPush]),
        (protocols.RolloutSchedule, [Synchronous, OneStepOff, FullyAsync]),
        (protocols.Evaluator, [InStepEval, BesideEval]),
        (protocols.EvaluationsBeside, [EvalEngine, SimEvalBeside]),
    ]


def test_every_part_answers_its_protocol_in_the_product_and_in_the_simulated_week():
    """Each method of each protocol exists on every implementation, taking the protocol's parameters in order (an
    implementation may take more after them, with defaults)."""
    missing = []
    for protocol, classes in implementations():
        for cls in classes:
            for name in protocol_methods(protocol):
                method = getattr(cls, name, None)
                wanted = parameters(getattr(protocol, name))
                wanted = [p for p in wanted if p not in ("args", "kwargs")]
                if method is None or parameters(method)[: len(wanted)] != wanted:
                    missing.append(f"{cls.__qualname__}.{name}{wanted}")
    assert missing == []


def remote_calls(path: Path) -> set[str]:
    """The RolloutManager methods a module calls as `<...>manager.<name>.remote(...)`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Attribute):
            owner = node.value.value
            if ast.unparse(owner).endswith("manager"):
                names.add(node.value.attr)
    return names


def test_the_manager_answers_every_remote_call_of_the_driver_in_the_product_and_in_the_simulated_week():
    from benchmarks.studies.guard_week.parts import SimManager
    from slime_search.rollout.manager import RolloutManager

    called = set().union(*(remote_calls(path) for path in RUN.glob("*.py")))
    assert {"state_dict", "restart_engine", "evaluate"} <= called  # the scan sees the driver's calls
    for manager in (RolloutManager, SimManager):
        assert sorted(name for name in called if not hasattr(manager, name)) == [], manager.__name__


def test_the_loop_carries_out_a_rollback_and_a_stop_and_nothing_else():
    """A rollback returns the step to go on from and a stop ends the run (both through Recovery.carry_out); any other
    event reaching the loop is an error, not ignored."""
    from slime_search.health.events import Event
    from slime_search.run.recovery import Recovery

    recovery = Recovery.__new__(Recovery)
    done = []
    recovery.roll_back = lambda event: done.append(("rollback", event.step)) or 4
    recovery.stop = lambda event: done.append(("stop", event.step)) or (_ for _ in ()).throw(SystemExit(3))
    assert recovery.carry_out(Event(9, "rollback", "reward_drop", "")) == 4
    with pytest.raises(SystemExit):
        recovery.carry_out(Event(10, "stop", "reward_errors", ""))
    with pytest.raises(ValueError, match="not 'warn'"):
        recovery.carry_out(Event(11, "warn", "logprob_gap", "a warning"))
    assert done == [("rollback", 9), ("stop", 10)]


def test_a_part_that_fails_to_start_stops_every_part_started_before_it_in_reverse(monkeypatch, tmp_path):
    """The actor fails to load after the engines started: leaving the stack stops the engines' manager, then the
    actor's group, then closes the metrics sink; no transport was made."""
    import ray

    from slime_search.health.config import HealthConfig
    from slime_search.ray import placement, session, train_group
    from slime_search.run.parts import open_parts

    stopped = []

    class Group:
        def __init__(self, config):
            pass

        def load_models(self, source, actor):
            raise RuntimeError("out of memory while loading the actor")

        def shutdown(self):
            stopped.append("group")

    class Sink:
        def __init__(self, path, *wandb, config):
            pass

        def close(self):
            stopped.append("sink")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(session, "record_started_processes", lambda path: None)
    monkeypatch.setattr(train_group, "RayTrainGroup", Group)
    monkeypatch.setattr("slime_search.metrics.MetricsSink", Sink)
    monkeypatch.setattr(placement, "create_rollout_manager", lambda *a, **k: "the manager")
    monkeypatch.setattr(placement, "stop_rollout_manager", lambda manager: stopped.append(manager))
    config = SimpleNamespace(
        run_dir=str(tmp_path / "run"), health=HealthConfig(), wandb=(False, "", None), colocate=False,
        eval_engine=None, rollout=None, train_group=None, model=None, actor=None,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory"), ExitStack() as stack:
        open_parts(config, SimpleNamespace(), stack)
    assert stopped == ["the manager", "group", "sink"]
