"""Questions and search queries from the shared data (`../shared/data/README.md`), for the instruments that load a
server with real requests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


def load_queries(folder: Path, limit: int) -> list[str]:
    """Unique <search> queries issued by the real Search-R1 model, in file order."""
    seen: dict[str, None] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.open():
            for query in _SEARCH.findall(json.loads(line)["response"]):
                query = " ".join(query.split())
                if query and len(query) < 500:
                    seen.setdefault(query, None)
    queries = list(seen)[:limit]
    if len(queries) < limit:
        print(f"note: only {len(queries)} unique queries found", file=sys.stderr)
    return queries


def load_questions(path: Path, limit: int) -> list[str]:
    """The first `limit` questions of a QA set's JSONL file."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row["question"] for row in rows[:limit]]
