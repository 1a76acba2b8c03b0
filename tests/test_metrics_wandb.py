"""What MetricsSink hands to wandb: every record a wandb step of its own (wandb drops a log whose step is not above
the newest), plotted against the train step ("step"), or evaluations against the version they evaluated. wandb is
replaced by a stand-in that records the calls and holds the sink to wandb's rule on steps."""

import sys
from types import ModuleType

import pytest

from slime_search.metrics import MetricsSink


class WandbRunStandIn:
    """The run wandb.init returns, as far as the sink uses it; anything else it is asked for fails the test."""

    def __init__(self):
        self.calls: list[tuple] = []  # ("define_metric", name, step_metric) and ("log", step, values), in order
        self.finished = False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.calls.append(("define_metric", name, step_metric))

    def log(self, values: dict, step: int) -> None:
        logged = [call[1] for call in self.calls if call[0] == "log"]
        assert not logged or step > logged[-1], f"wandb would drop the log at step {step} (newest {logged[-1]})"
        self.calls.append(("log", step, dict(values)))

    def finish(self) -> None:
        self.finished = True

    def __getattr__(self, name):
        raise AssertionError(f"the wandb stand-in does not implement {name!r}")

    def logs(self) -> list[tuple[int, dict]]:
        return [(step, values) for kind, step, values in self.calls if kind == "log"]

    def axes(self) -> dict[str, str | None]:
        defined = [(name, axis) for kind, name, axis in self.calls if kind == "define_metric"]
        assert len({name for name, _ in defined}) == len(defined), f"a key defined twice: {defined}"
        return dict(defined)


@pytest.fixture
def wandb_run(monkeypatch):
    run = WandbRunStandIn()
    module = ModuleType("wandb")  # only init: anything else the sink reached for would fail loudly
    module.init = lambda **kwargs: run
    monkeypatch.setitem(sys.modules, "wandb", module)
    return run


def test_redone_steps_after_a_rollback_get_wandb_steps_of_their_own(wandb_run, tmp_path):
    """Steps 0-5, a late evaluation of version 2, then a rollback to step 3 and steps 3-5 again: ten records, ten
    increasing wandb steps, each record with its train step; the redone steps do not pile up on one wandb step."""
    sink = MetricsSink(tmp_path, use_wandb=True)
    for step in range(6):
        sink.log(step, {"train/loss": 0.1 * step, "weight_version": step + 1, "eval/running_age_s": 1.0})
    sink.log(2, {"eval/em": 0.5, "weight_version": 2})
    sink.drop_from(3)
    for step in range(3, 6):
        sink.log(step, {"train/loss": 0.2 * step, "weight_version": step + 1, "eval/running_age_s": 0.0})
    sink.close()

    logs = wandb_run.logs()
    assert [wandb_step for wandb_step, _ in logs] == list(range(10))
    assert [values["step"] for _, values in logs] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    assert logs[6][1]["eval/em"] == 0.5 and logs[6][1]["weight_version"] == 2
    assert [values["train/loss"] for _, values in logs[7:]] == [0.2 * step for step in range(3, 6)]
    assert [r["step"] for r in sink.read()] == [0, 1, 2, 2, 3, 4, 5]  # the jsonl forgot the undone steps
    assert wandb_run.finished

    assert wandb_run.axes() == {
        "step": None,
        "time": "step",
        "train/loss": "step",
        "weight_version": None,
        "eval/running_age_s": "weight_version",
        "eval/em": "weight_version",
    }
    first_log = {}
    for position, call in enumerate(wandb_run.calls):
        if call[0] == "log":
            for key in call[2]:
                first_log.setdefault(key, position)
    defined_at = {call[1]: position for position, call in enumerate(wandb_run.calls) if call[0] == "define_metric"}
    assert all(defined_at[key] < first_log[key] for key in first_log), "a key was logged before its x-axis was told"
