"""The suite byte-compiles the project once before its workers start, although this machine kind forbids Python to
cache bytecode (PYTHONDONTWRITEBYTECODE): every process it starts then reads the cache instead of compiling."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import COMPILED_PACKAGES, REPO_ROOT, compile_sources


def test_the_packages_are_compiled_where_python_would_write_no_bytecode(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for module in ("pkg/__init__.py", "pkg/sub/mod.py"):
        (tmp_path / module).write_text("VALUE = 1\n")
    compile_sources(tmp_path, ("pkg",))
    for module in ("pkg/__init__.py", "pkg/sub/mod.py"):
        assert Path(importlib.util.cache_from_source(str(tmp_path / module))).is_file()


def test_a_file_that_does_not_compile_is_an_error(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n")
    with pytest.raises(RuntimeError, match="does not compile"):
        compile_sources(tmp_path, ("pkg",))


def test_the_compiled_packages_are_the_projects_own():
    assert all((REPO_ROOT / package).is_dir() for package in COMPILED_PACKAGES)
