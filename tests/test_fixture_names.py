"""No fixture of this test suite takes the name of a fixture that pytest or an installed pytest plugin defines.

A shadowed plugin fixture can break the plugin's own hooks for every test that requests it: pytest-benchmark, which
machines like the CI's have installed, fails the whole session when a test's `benchmark` is not its own."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_fixture_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
        isinstance(target, ast.Name) and target.id == "fixture"
    )


def fixture_name(function: ast.FunctionDef | ast.AsyncFunctionDef, decorator: ast.expr) -> str:
    if isinstance(decorator, ast.Call):
        for keyword in decorator.keywords:
            if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                return keyword.value.value
    return function.name


def suite_fixtures() -> dict[str, list[str]]:
    """Every fixture this test suite defines: its name -> the files that define it."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for decorator in node.decorator_list:
                    if is_fixture_decorator(decorator):
                        found.setdefault(fixture_name(node, decorator), []).append(str(path.relative_to(TESTS)))
    return found


def test_the_suite_finds_its_own_fixtures():
    fixtures = suite_fixtures()
    assert "tiny_checkpoint" in fixtures and "twin_runs" in fixtures, "the fixture scan has stopped seeing fixtures"


def test_no_fixture_shadows_one_of_pytest_or_an_installed_plugin(request):
    manager = request._fixturemanager  # pytest's registry: the fixtures of pytest and of every loaded plugin
    clashes = []
    for name, files in suite_fixtures().items():
        for definition in manager.getfixturedefs(name, request.node) or ():
            module = getattr(definition.func, "__module__", "") or ""
            if not module.startswith("tests"):
                clashes.append(f"{name!r} (defined in {', '.join(files)}) shadows the fixture of {module}")
    assert not clashes, "rename these fixtures:\n" + "\n".join(clashes)
