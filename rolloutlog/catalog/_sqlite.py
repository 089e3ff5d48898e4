"""SQLite backend (``sqlite+aiosqlite:///path``): the embedded default.

Every write transaction starts with ``BEGIN IMMEDIATE``, so writers queue on SQLite's one write
lock (waiting up to ``busy_timeout``) instead of failing when a read transaction tries to upgrade;
read transactions use a plain deferred ``BEGIN`` and, in WAL mode, read one snapshot without
blocking writers. ``synchronous=FULL`` makes a commit durable once it returns: a committed
checkpoint is a promise to the trainer.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import Table, event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from rolloutlog.catalog._backend import Backend, integrity_error
from rolloutlog.errors import BackendUnavailable, CatalogError, RolloutlogError

_READ_ONLY = "rolloutlog_read_only"
_BUSY_TIMEOUT_MS = 30_000
_PRAGMAS = (
    # First, so that the journal-mode switch of a brand-new file waits for other openers.
    f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}",
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
)
_UNAVAILABLE = ("database is locked", "busy", "unable to open", "disk i/o", "readonly database")


class SQLiteBackend(Backend):
    name: ClassVar[str] = "sqlite"

    def create_engine(self) -> AsyncEngine:
        url = make_url(self.url)
        database = url.database
        if not database or database == ":memory:" or "mode=memory" in database:
            # Each pooled connection would see its own empty database: refuse rather than diverge.
            raise CatalogError(
                "an in-memory SQLite catalog is not supported; give a file path, "
                "e.g. sqlite+aiosqlite:///rolloutlog-data/catalog.db",
                url=self.url,
            )
        if not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, pool_size=4, max_overflow=4)
        event.listen(engine.sync_engine, "connect", _on_connect)
        event.listen(engine.sync_engine, "begin", _on_begin)
        return engine

    def read_engine(self, engine: AsyncEngine) -> AsyncEngine:
        return engine.execution_options(**{_READ_ONLY: True})

    async def bulk_insert(
        self,
        conn: AsyncConnection,
        table: Table,
        columns: Sequence[str],
        rows: list[tuple[Any, ...]],
    ) -> None:
        if not rows:
            return
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        names = ", ".join(f'"{name}"' for name in columns)
        marks = ", ".join("?" for _ in columns)
        cursor = await driver.executemany(
            f'INSERT INTO "{table.name}" ({names}) VALUES ({marks})', rows
        )
        await cursor.close()

    def driver_errors(self) -> tuple[type[BaseException], ...]:
        return (sqlite3.Error,)

    def classify(self, error: BaseException) -> RolloutlogError | None:
        if isinstance(error, sqlite3.IntegrityError):
            return integrity_error(error)
        if isinstance(error, sqlite3.OperationalError):
            text = str(error).lower()
            if any(part in text for part in _UNAVAILABLE):
                return BackendUnavailable(f"SQLite catalog unavailable: {error}", backend=self.name)
            if "no such table" in text:
                return CatalogError(
                    f"the catalog has no schema ({error}); call start() to migrate it",
                    backend=self.name,
                )
        return None


def _on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to _on_begin: pysqlite's own implicit BEGIN comes too late
    # (only before DML), which would let a transaction read before it holds the write lock.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        for pragma in _PRAGMAS:
            cursor.execute(pragma)
    finally:
        cursor.close()


def _on_begin(conn: Connection) -> None:
    read_only = conn.get_execution_options().get(_READ_ONLY, False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
