"""Docstrings make one claim per sentence: no sentence of a product or instrument docstring runs past LONGEST words.
Indented lines (commands, examples) and the rows of tables are not prose and are not counted."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO_ROOT

PACKAGES = ("slime_search", "megatron_bridge", "local_dense_retriever", "benchmarks", "tools")
LONGEST = 40  # words; the house's median sentence is about 14
TABLE_ROW = re.compile(r"^\||\S {2,}\S")  # a markdown table's row, or two or more spaces inside a line: a column


def sentences(doc: str) -> list[str]:
    """The prose sentences of a docstring: paragraphs and bullets split into sentences at . ! ? and ;"""
    found = []
    for paragraph in re.split(r"\n\s*\n", doc):
        lines = [line for line in paragraph.splitlines() if not line.startswith(" ") and not TABLE_ROW.search(line)]
        for item in re.split(r"\n(?=[-*] )", "\n".join(lines)):
            prose = " ".join(item.split())
            found += [s for s in re.split(r"(?<=[.!?;])\s+", prose) if s.split()]
    return found


def long_sentences(path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for sentence in sentences(ast.get_docstring(node) or ""):
                if len(sentence.split()) > LONGEST:
                    out.append(f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', 1)}: {sentence[:100]}...")
    return out


def test_no_docstring_sentence_runs_past_the_longest():
    files = [path for package in PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))]
    assert len(files) > 200
    assert [line for path in files for line in long_sentences(path)] == []


def test_sentences_split_at_their_ends_and_skip_commands_and_tables():
    doc = "One claim. Another one; a third?\n\n    python -m x --flag    # a command\nname   what it does\n| a | b |\n- a bullet"
    assert sentences(doc) == ["One claim.", "Another one;", "a third?", "- a bullet"]
