"""Every instrument in benchmarks/perf/ and benchmarks/studies/ opens with its own command, names the page of
docs/benchmarks/ that records its figures (a page that names it back), and is run or imported by a test."""

import ast
import re

import pytest

from tests.conftest import REPO_ROOT

ROOMS = ("benchmarks/perf", "benchmarks/studies")


def instruments() -> list[str]:
    found = []
    for room in ROOMS:
        for path in sorted((REPO_ROOT / room).iterdir()):
            if path.suffix == ".py" and not path.name.startswith("__") or (path / "__init__.py").is_file():
                found.append(f"{room.replace('/', '.')}.{path.stem}")
    return found


def docstring(module: str) -> str:
    path = REPO_ROOT / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_the_rooms_hold_the_instruments():
    assert len(instruments()) >= 25 and "benchmarks.studies.guard_week" in instruments()


@pytest.mark.parametrize("module", instruments())
def test_an_instrument_states_its_command_and_its_page_and_is_tested(module):
    text = docstring(module)
    assert f"python -m {module}" in text, f"{module}: its docstring gives no `python -m {module}` command"
    pages = set(re.findall(r"docs/benchmarks/(\w+\.md)", text))
    assert pages, f"{module}: its docstring names no docs/benchmarks/ page"
    for page in pages:
        assert module in (REPO_ROOT / "docs" / "benchmarks" / page).read_text(), f"{page} does not name {module}"
    tests = "".join(p.read_text() for p in (REPO_ROOT / "tests").rglob("*.py") if p.name != "test_rooms.py")
    room, _, name = module.rpartition(".")
    assert module in tests or re.search(rf"from {re.escape(room)} import [^\n]*\b{name}\b", tests), module
