"""Run records as JSON lines (metrics.jsonl, rollouts.jsonl): appended whole, read back without a torn tail.

Each append is one `write` of complete lines, so a killed run leaves at most one partial line, and only at the end;
reading drops that tail (it belongs to a step the resumed run redoes). Rewrites go through a temporary file and a
rename, so a kill mid-rewrite leaves the old file or the new one, never half of each.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class RecordsError(ValueError):
    """A line other than the last is not a JSON record: the file was edited or damaged, not torn by a kill."""


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it in one write; the loop only guards a short write
            view = view[os.write(descriptor, view) :]
    finally:
        os.close(descriptor)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of the file (none when it does not exist), without a torn last line."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    tail = lines.pop()  # "" when the file ends with a newline, as every whole append does
    if tail:
        logger.warning("%s: dropping a torn last line (%d characters) left by an interrupted run", path, len(tail))
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise RecordsError(f"{path}:{number}: not a JSON record ({err.msg})") from None
    return records


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the file's records with `records`: the old file or the new one survives a kill, never half of each."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    os.replace(partial, path)


def keep_records_before(path: Path, step: int) -> int:
    """Keep only the records of steps < `step` (a resumed run redoes the others); returns how many were dropped."""
    if not path.is_file():
        return 0
    records = read_records(path)
    kept = [record for record in records if record["step"] < step]
    write_records(path, kept)
    return len(records) - len(kept)
