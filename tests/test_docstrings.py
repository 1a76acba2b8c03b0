"""Docstrings make one claim per sentence: no sentence of a product or instrument docstring runs past LONGEST words.
Indented lines (commands, examples) and the rows of aligned tables are not prose and are not counted.

The files that still hold such sentences are listed in docstring_long_sentences.json with how many: a file may not
gain one, and a file that loses one must have its count lowered (the list only shrinks)."""

from __future__ import annotations

import ast
import json
import re

from tests.conftest import REPO_ROOT

PACKAGES = ("slime_search", "megatron_bridge", "local_dense_retriever", "benchmarks", "tools")
LONGEST = 40  # words; the house's median sentence is about 15
ALLOWED = REPO_ROOT / "tests" / "docstring_long_sentences.json"  # file -> sentences over LONGEST it still holds
TABLE_ROW = re.compile(r"\S {2,}\S")  # two or more spaces inside a line: a column of an aligned table


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
            doc = ast.get_docstring(node)
            for sentence in sentences(doc or ""):
                if len(sentence.split()) > LONGEST:
                    out.append(f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', 1)}: {sentence[:100]}...")
    return out


def long_sentence_counts() -> dict[str, int]:
    files = [path for package in PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))]
    assert len(files) > 200
    counts = {str(path.relative_to(REPO_ROOT)): len(long_sentences(path)) for path in files}
    return {name: count for name, count in counts.items() if count}


def test_no_file_gains_a_long_docstring_sentence_and_the_list_only_shrinks():
    allowed, counts = json.loads(ALLOWED.read_text()), long_sentence_counts()
    gained = {name: count for name, count in counts.items() if count > allowed.get(name, 0)}
    assert gained == {}, f"sentences over {LONGEST} words: " + "; ".join(
        line for path in gained for line in long_sentences(REPO_ROOT / path)
    )
    shrunk = {name: counts.get(name, 0) for name, allowance in allowed.items() if counts.get(name, 0) < allowance}
    assert shrunk == {}, f"lower these counts in {ALLOWED.name}: {shrunk}"


def test_sentences_split_at_their_ends_and_skip_commands_and_tables():
    doc = "One claim. Another one; a third?\n\n    python -m x --flag    # a command\nname   what it does\n- a bullet"
    assert sentences(doc) == ["One claim.", "Another one;", "a third?", "- a bullet"]
