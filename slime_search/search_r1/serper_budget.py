"""A spending cap on web search: billed Serper calls counted for the whole run, whatever process makes them.

Serper bills every query it answers. The count lives in a small SQLite file (by default in the run folder), so the
rollout, an evaluation beside it and a resumed run all draw on one budget. A call is reserved before it is sent,
one reservation per attempt. The reservation is an atomic conditional increment: two processes can never both take
the last call. It is given back only when that attempt certainly was not billed (see NOT_BILLED_STATUSES in
search_clients). That atomicity rests on SQLite's file locks, which network and cluster filesystems (NFS, Lustre, SMB,
GPFS, ...) do not reliably provide. So a ledger there is refused, naming the filesystem (`--serper-ledger` puts it on
a local disk). At the cap, `--serper-at-budget stop` stops the run with a message naming the cap. With `replay` the
run goes on answering from the Serper cache only, and a query not in it fails its sample.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slime_search.search_r1.search_error import SearchError

AT_BUDGET = ("stop", "replay")
LEDGER_NAME = "serper_spend.sqlite"
MOUNTS_TABLE = "/proc/mounts"
# Filesystems whose POSIX locks SQLite cannot trust across processes or hosts (SQLite's own FAQ warns of network
# filesystems); `fuse.*` are the /proc/mounts names of FUSE-mounted ones.
UNRELIABLE_LOCKS = frozenset(
    {"nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "9p", "afs", "panfs", "wekafs"}
    | {"fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.ceph", "fuse.juicefs", "fuse.rclone"}
)


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


def mount_of(path: str, mounts: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding the absolute `path`, from a /proc/mounts table: the longest
    mount point at or above it (at equal length the later line, which mounts over the earlier)."""
    found = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, fields[2])
    return found


def unreliable_lock_mount(path: str, mounts: str) -> tuple[str, str] | None:
    """The (mount point, type) holding `path` when SQLite's locks are not reliable there, else None."""
    found = mount_of(path, mounts)
    return found if found is not None and found[1] in UNRELIABLE_LOCKS else None


def check_ledger_filesystem(path: str | Path, mounts_table: str | Path | None = None) -> None:
    """RuntimeError naming the filesystem when the ledger at `path` would sit where its lock cannot be trusted (two
    processes could then both take the last call, or corrupt the count). Nothing is checked without a mounts table
    (`mounts_table`, else MOUNTS_TABLE: Linux's)."""
    try:
        mounts = Path(mounts_table or MOUNTS_TABLE).read_text()
    except OSError:
        return
    where = os.path.realpath(Path(path).absolute())  # symlinks resolved: the filesystem the file lands on
    found = unreliable_lock_mount(where, mounts)
    if found is not None:
        point, kind = found
        raise RuntimeError(
            f"the Serper budget ledger {where} would be on a {kind} filesystem (mounted at {point}), whose file locks "
            "SQLite cannot rely on, so the run's billed calls could be miscounted and the cap exceeded; put the "
            f"ledger on a local disk with --serper-ledger /local/path/{LEDGER_NAME} (every process drawing on the "
            "budget must run on that machine; keep the same path on resume to keep the count)"
        )


class SpendLedger:
    """The run's billed-call count in SQLite: reserve before each attempt, release one that certainly was not billed.
    Refuses a path on a filesystem where SQLite's locks are not reliable."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        check_ledger_filesystem(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with self._connection() as db:
            db.execute("CREATE TABLE IF NOT EXISTS spend (id INTEGER PRIMARY KEY CHECK (id = 0), calls INTEGER)")
            db.execute("INSERT OR IGNORE INTO spend (id, calls) VALUES (0, 0)")

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """A connection of its own per call (any thread or process may count), closed after: `with sqlite3.connect()`
        alone would only end a transaction and leave the file open. Autocommit: each UPDATE is its own transaction."""
        with self._lock:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            try:
                yield db
            finally:
                db.close()

    def reserve(self, cap: int | None) -> bool:
        """One more billed call, unless `cap` calls are spent already (atomic across processes)."""
        with self._connection() as db:
            if cap is None:
                db.execute("UPDATE spend SET calls = calls + 1 WHERE id = 0")
                return True
            return db.execute("UPDATE spend SET calls = calls + 1 WHERE id = 0 AND calls < ?", (cap,)).rowcount == 1

    def release(self) -> None:
        with self._connection() as db:
            db.execute("UPDATE spend SET calls = calls - 1 WHERE id = 0 AND calls > 0")

    def spent(self) -> int:
        with self._connection() as db:
            return int(db.execute("SELECT calls FROM spend WHERE id = 0").fetchone()[0])
