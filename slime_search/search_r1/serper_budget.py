"""A spending cap on web search: billed Serper calls counted for the whole run, whatever process makes them.

Serper bills every query it answers. The count lives in a small SQLite file (by default in the run folder), so the
rollout, an evaluation beside it and a resumed run all draw on one budget. A call is reserved before it is sent
(an atomic conditional increment: two processes can never both take the last call) and given back if it fails
without an answer. At the cap, `--serper-at-budget stop` stops the run with a message naming the cap, and
`replay` goes on answering from the Serper cache only (a query not in it fails its sample).
"""

from __future__ import annotations

import math
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from slime_search.search_r1.search_error import SearchError

AT_BUDGET = ("stop", "replay")
LEDGER_NAME = "serper_spend.sqlite"


class BudgetSpent(SearchError):
    """The web-search budget is spent and the run was asked to stop there."""


@dataclass(frozen=True)
class SerperBudget:
    max_calls: int | None = None
    max_usd: float | None = None
    usd_per_call: float = 0.001
    at_budget: str = "stop"
    ledger_path: str | None = None

    def __post_init__(self) -> None:
        if self.at_budget not in AT_BUDGET:
            raise ValueError(f"--serper-at-budget must be one of {', '.join(AT_BUDGET)}, got {self.at_budget!r}")
        if self.usd_per_call < 0:
            raise ValueError(f"--serper-usd-per-call must be >= 0, got {self.usd_per_call}")
        if self.limited and not self.ledger_path:
            raise ValueError("a Serper budget is counted over the run: give --save (or --serper-ledger)")

    @property
    def limited(self) -> bool:
        return self.max_calls is not None or self.max_usd is not None

    @property
    def call_cap(self) -> int | None:
        """Billed calls allowed: the lower of --serper-budget-calls and what --serper-budget-usd buys."""
        caps = []
        if self.max_calls is not None:
            caps.append(self.max_calls)
        if self.max_usd is not None:
            caps.append(math.floor(self.max_usd / self.usd_per_call + 1e-9) if self.usd_per_call else math.inf)
        finite = [int(c) for c in caps if c != math.inf]
        return min(finite) if finite else None

    def describe(self) -> str:
        parts = []
        if self.max_calls is not None:
            parts.append(f"--serper-budget-calls {self.max_calls}")
        if self.max_usd is not None:
            parts.append(f"--serper-budget-usd {self.max_usd:g} at ${self.usd_per_call:g} a call")
        return ", ".join(parts)


class SpendLedger:
    """The run's billed-call count in SQLite: reserve before a call, release when it brought no answer."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with self._connect() as db:
            db.execute("CREATE TABLE IF NOT EXISTS spend (id INTEGER PRIMARY KEY CHECK (id = 0), calls INTEGER)")
            db.execute("INSERT OR IGNORE INTO spend (id, calls) VALUES (0, 0)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30.0, isolation_level=None)

    def reserve(self, cap: int | None) -> bool:
        """One more billed call, unless `cap` calls are spent already (atomic across processes)."""
        with self._lock, self._connect() as db:
            if cap is None:
                db.execute("UPDATE spend SET calls = calls + 1 WHERE id = 0")
                return True
            return db.execute("UPDATE spend SET calls = calls + 1 WHERE id = 0 AND calls < ?", (cap,)).rowcount == 1

    def release(self) -> None:
        with self._lock, self._connect() as db:
            db.execute("UPDATE spend SET calls = calls - 1 WHERE id = 0 AND calls > 0")

    def spent(self) -> int:
        with self._lock, self._connect() as db:
            return int(db.execute("SELECT calls FROM spend WHERE id = 0").fetchone()[0])
