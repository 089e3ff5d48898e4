"""Where a policy server keeps its ledger rows: in its process, or shared by its workers.

A policy server with several worker processes gets a rollout's calls on different workers, so a
parent recorded by one must resolve in another. ``SharedLedger`` keeps the rows in a SQLite file
the workers of one host share (WAL: readers never wait for the writer). It is a cache of the
log, not a second source of truth: a row is written there after its ``ledger.row`` is durable
and before the reply leaves, so any child call (which needs the reply) finds it; a host that
dies loses the file and the restore installs the rows from the log again. Hence no fsync
(``synchronous=OFF``). Measured in ``benchmarks/policy_ledger.py`` (docs/design.md).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from typing import Protocol

import orjson

from rolloutlog.core import LedgerEntry

__all__ = ["LedgerRowInfo", "LedgerStore", "MemoryLedger", "SharedLedger"]


#: A ledger row as the policy keeps it (recorded here, or restored from a projection): the one
#: row type, ``core.LedgerEntry``, without its token ids; ``recorded_by`` is the worker that
#: recorded it (None for a row restored from a projection).
LedgerRowInfo = LedgerEntry


class LedgerStore(Protocol):
    """The rows of each capture key, and one-time claims (a restored generation cut is
    continued by one call, on whichever worker gets it first)."""

    #: This process's name among the workers (``recorded_by`` of the rows it puts).
    worker: str

    def get(self, capture_key: str, call_id: str) -> LedgerRowInfo | None: ...

    def matching(self, capture_key: str, fingerprint: str) -> list[LedgerRowInfo]: ...

    def put(self, capture_key: str, row: LedgerRowInfo) -> None: ...

    def install(self, capture_key: str, rows: Iterable[LedgerRowInfo]) -> int:
        """Add restored rows (a row already there is kept: another worker installed it, or the
        attempt recorded it since)."""
        ...

    def claim(self, name: str) -> bool:
        """True for the first caller of ``name`` among all the workers, False after."""
        ...


class MemoryLedger:
    """The rows in this process's memory (a single-process policy server)."""

    def __init__(self, worker: str = "w0") -> None:
        self.worker = worker
        #: capture key -> call id -> row
        self.rows: dict[str, dict[str, LedgerRowInfo]] = {}
        self._claims: set[str] = set()

    def get(self, capture_key: str, call_id: str) -> LedgerRowInfo | None:
        return self.rows.get(capture_key, {}).get(call_id)

    def matching(self, capture_key: str, fingerprint: str) -> list[LedgerRowInfo]:
        rows = self.rows.get(capture_key, {}).values()
        return [row for row in rows if row.fingerprint == fingerprint]

    def put(self, capture_key: str, row: LedgerRowInfo) -> None:
        self.rows.setdefault(capture_key, {})[row.call_id] = row

    def install(self, capture_key: str, rows: Iterable[LedgerRowInfo]) -> int:
        kept = self.rows.setdefault(capture_key, {})
        count = 0
        for row in rows:
            kept.setdefault(row.call_id, row)
            count += 1
        return count

    def claim(self, name: str) -> bool:
        if name in self._claims:
            return False
        self._claims.add(name)
        return True


_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    capture_key TEXT NOT NULL,
    call_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    row BLOB NOT NULL,
    PRIMARY KEY (capture_key, call_id)
);
CREATE INDEX IF NOT EXISTS ledger_fingerprint ON ledger (capture_key, fingerprint);
CREATE TABLE IF NOT EXISTS claims (name TEXT PRIMARY KEY);
"""


class SharedLedger:
    """The rows in a SQLite file shared by the worker processes of one policy server (one
    host). Give every worker the same ``path`` and its own ``worker`` name; start each policy
    server (incarnation) with a new file, since rows are keyed by capture key only.

    Calls are synchronous: each is one indexed statement on a local file (tens of
    microseconds), cheaper than handing it to a thread.
    """

    def __init__(self, path: str, worker: str) -> None:
        self.path = path
        self.worker = worker
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 10000")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = OFF")
        with self._lock:
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def get(self, capture_key: str, call_id: str) -> LedgerRowInfo | None:
        with self._lock:
            found = self._db.execute(
                "SELECT row FROM ledger WHERE capture_key = ? AND call_id = ?",
                (capture_key, call_id),
            ).fetchone()
        return None if found is None else LedgerRowInfo.from_json(orjson.loads(found[0]))

    def matching(self, capture_key: str, fingerprint: str) -> list[LedgerRowInfo]:
        with self._lock:
            found = self._db.execute(
                "SELECT row FROM ledger WHERE capture_key = ? AND fingerprint = ?",
                (capture_key, fingerprint),
            ).fetchall()
        return [LedgerRowInfo.from_json(orjson.loads(raw)) for (raw,) in found]

    def put(self, capture_key: str, row: LedgerRowInfo) -> None:
        self._insert("INSERT OR REPLACE", capture_key, [row])

    def install(self, capture_key: str, rows: Iterable[LedgerRowInfo]) -> int:
        return self._insert("INSERT OR IGNORE", capture_key, rows)

    def claim(self, name: str) -> bool:
        with self._lock:
            cursor = self._db.execute("INSERT OR IGNORE INTO claims (name) VALUES (?)", (name,))
        return cursor.rowcount == 1

    def _insert(self, verb: str, capture_key: str, rows: Iterable[LedgerRowInfo]) -> int:
        values = [
            (capture_key, row.call_id, row.fingerprint, orjson.dumps(row.to_json())) for row in rows
        ]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    f"{verb} INTO ledger (capture_key, call_id, fingerprint, row) "
                    "VALUES (?, ?, ?, ?)",
                    values,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return len(values)
