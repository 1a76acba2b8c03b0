"""RunParts for tests that exercise some of the run's parts: the parts a test does not give are stand-ins that fail
loudly when the code under test reaches for them (a test that passes never relied on one)."""

from __future__ import annotations

from slime_search.run.parts import RunParts

PARTS = ("config", "folder", "sink", "group", "guard", "manager", "transport", "colocation", "evaluator", "schedule")


class NotGiven:
    """A part this test does not give: any use of it is an error naming the part."""

    def __init__(self, part: str):
        self._part = part

    def __getattr__(self, name: str):
        raise AssertionError(f"the code under test used the run's {self._part} ({name}), which this test does not give")

    def __bool__(self) -> bool:
        raise AssertionError(f"the code under test tested the run's {self._part}, which this test does not give")


def run_parts(**given) -> RunParts:
    """RunParts of the parts given by name (the transport defaults to None: no engines take weights); every other
    part is NotGiven."""
    unknown = set(given) - set(PARTS) - {"clock", "checkpoint_bytes"}
    if unknown:
        raise TypeError(f"not parts of a run: {sorted(unknown)}")
    given.setdefault("transport", None)
    return RunParts(**{part: given.pop(part) if part in given else NotGiven(part) for part in PARTS}, **given)
