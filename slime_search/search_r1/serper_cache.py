"""A persistent cache of Serper answers in SQLite, shared by runs and processes, for billed-call savings and
reproducible evaluation. In replay-only mode answers come from the cache or not at all.

The key is the normalised query plus every setting that changes the documents (endpoint, number of results,
snippets or pages), so a different setting never reads another's answer. What is stored is the documents the
client built, not Serper's raw answer. With page fetching on, the documents depend on web pages that change.
Replaying the raw answer would fetch them again and could give other observations.

Several processes may share one file (runs side by side, Ray workers). SQLite's write-ahead log lets readers go on
while one writer commits. Each write is one short transaction, and a writer waits (busy timeout) rather than fail.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BUSY_TIMEOUT_MS = 30_000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS serper_answers (
    key TEXT PRIMARY KEY,
    query TEXT NOT NULL,
    settings TEXT NOT NULL,
    documents TEXT NOT NULL,
    created REAL NOT NULL
)
"""


def normalise_query(query: str) -> str:
    """NFC, whitespace runs collapsed, case folded: the variants a policy writes of one query share an entry (web
    search is insensitive to them; the observation never shows the query)."""
    return " ".join(unicodedata.normalize("NFC", query).split()).casefold()


@dataclass(frozen=True)
class CacheSettings:
    """What, besides the query, decides the documents of a Serper search."""

    endpoint: str
    topk: int
    snippet_only: bool

    def as_json(self) -> str:
        return json.dumps({"endpoint": self.endpoint, "topk": self.topk, "snippet_only": self.snippet_only})


def cache_key(query: str, settings: CacheSettings) -> str:
    return hashlib.sha256(f"{normalise_query(query)}\n{settings.as_json()}".encode()).hexdigest()


class SerperCache:
    """get/put of documents by query and settings; one connection per call, so any thread or process may use it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connection() as db:
            db.execute("PRAGMA journal_mode=WAL")  # persistent: set once for the file
            with db:
                db.execute(_SCHEMA)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            yield db
        finally:
            db.close()

    def get(self, query: str, settings: CacheSettings) -> list[dict] | None:
        with self._connection() as db:
            key = cache_key(query, settings)
            row = db.execute("SELECT documents FROM serper_answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, query: str, settings: CacheSettings, documents: list[dict]) -> None:
        """Store an answer; the first one stored for a key stays (a replay must keep giving what it gave)."""
        row = (
            cache_key(query, settings),
            normalise_query(query),
            settings.as_json(),
            json.dumps(documents),
            time.time(),
        )
        with self._connection() as db, db:  # the inner `with db` is the transaction
            db.execute("INSERT OR IGNORE INTO serper_answers VALUES (?, ?, ?, ?, ?)", row)

    def __len__(self) -> int:
        with self._connection() as db:
            return int(db.execute("SELECT COUNT(*) FROM serper_answers").fetchone()[0])
