"""SQLite backend (``sqlite+aiosqlite:///path``): the embedded default.

Every write transaction starts with ``BEGIN IMMEDIATE``, so writers queue on SQLite's one write
lock (waiting up to ``busy_timeout``) instead of failing when a read transaction tries to upgrade;
read transactions use a plain deferred ``BEGIN`` and, in WAL mode, read one snapshot without
blocking writers. ``synchronous=FULL`` makes a commit durable once it returns: a committed
checkpoint is a promise to the trainer.

WAL checkpoints (copying committed pages back into the database file, with an fsync) would by
default run inside whichever commit crosses 1,000 WAL pages, i.e. inside every other manifest
commit. Instead, a passive checkpoint runs in the background after each large commit, and the
automatic one is only a safety net at 16,384 pages.

A checkpoint's two transactions (begin, and the commit of its parts) run whole on one worker
thread over a synchronous connection to the same file (``write_in_one_hop``), in the catalog's
write turn: through aiosqlite each of their ~20 statements waited for the event loop's next turn,
and under saturating appends a turn takes several milliseconds (S4: the begin's four statements
took 30-90 ms, the commit's 60-100 ms; docs/catalog.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import orjson
from sqlalchemy import (
    ColumnElement,
    Table,
    Text,
    bindparam,
    create_engine,
    event,
    func,
    literal_column,
    select,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from rolloutlog.catalog._backend import Backend, integrity_error
from rolloutlog.catalog._turns import WriteTurns
from rolloutlog.errors import BackendUnavailable, CatalogError, RolloutlogError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_READ_ONLY = "rolloutlog_read_only"
_MAX_VARIABLES = 32_766  # SQLITE_MAX_VARIABLE_NUMBER since SQLite 3.32
_BUSY_TIMEOUT_MS = 30_000
_PRAGMAS = (
    # First, so that the journal-mode switch of a brand-new file waits for other openers.
    f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}",
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    # 64 MiB of page cache: a 16,000-entry commit must not spill half-written pages to the WAL.
    "PRAGMA cache_size=-65536",
    "PRAGMA wal_autocheckpoint=16384",
)
# Retriable: another writer holds the lock, or the disk is full or failing (SQLite rolls the
# transaction back, so nothing of the write stays; it may succeed once space returns).
_UNAVAILABLE = (
    "database is locked",
    "busy",
    "unable to open",
    "disk i/o",
    "readonly database",
    "disk is full",
)


class SQLiteBackend(Backend):
    name: ClassVar[str] = "sqlite"

    def write_turns(self) -> WriteTurns:
        """SQLite has one writer at a time and makes the others poll its lock: the catalog's
        writers take turns in the process instead (``_turns``)."""
        return WriteTurns()

    one_hop_writes: ClassVar[bool] = True

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._checkpointing: asyncio.Task[None] | None = None
        self._one_hop: Engine | None = None
        self._one_hop_thread: ThreadPoolExecutor | None = None

    async def write_in_one_hop(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        if self._one_hop is None or self._one_hop_thread is None:
            url = make_url(self.url).set(drivername="sqlite+pysqlite")
            # One connection, always used from the one thread.
            engine = create_engine(url, pool_size=1, max_overflow=0)
            event.listen(engine, "connect", _on_connect)
            event.listen(engine, "begin", _on_begin)
            self._one_hop = engine
            self._one_hop_thread = ThreadPoolExecutor(1, thread_name_prefix="rolloutlog-catalog")
        engine = self._one_hop
        done = asyncio.get_running_loop().run_in_executor(
            self._one_hop_thread, _run_whole, engine, fn
        )
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # The transaction runs on: the write turn is held until it has ended.
            with contextlib.suppress(Exception):
                await done
            raise

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

    def after_bulk_commit(self, engine: AsyncEngine) -> None:
        if self._checkpointing is None or self._checkpointing.done():
            self._checkpointing = asyncio.create_task(_checkpoint_wal(engine))

    async def close(self) -> None:
        task, self._checkpointing = self._checkpointing, None
        if task is not None:
            await task
        engine, thread = self._one_hop, self._one_hop_thread
        self._one_hop = self._one_hop_thread = None
        if engine is not None and thread is not None:  # closed by the thread that opened it
            await asyncio.get_running_loop().run_in_executor(thread, engine.dispose)
        if thread is not None:
            thread.shutdown(wait=True)

    async def bulk_insert(
        self,
        conn: AsyncConnection,
        table: Table,
        names: Sequence[str],
        columns: Sequence[Sequence[Any]],
    ) -> None:
        width, count = len(names), len(columns[0])
        if not count:
            return
        # Interleave the columns into one flat parameter list by slice assignment (C speed, no
        # per-row tuple), then insert with multi-row VALUES, as many rows per statement as
        # SQLite's bound-parameter limit allows: one VDBE program per batch instead of a reset
        # and rebind per row. Measured 30% faster than executemany for 16,000 rows.
        flat: list[Any] = [None] * (width * count)
        for index, column in enumerate(columns):
            flat[index::width] = column
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        quoted = ", ".join(f'"{name}"' for name in names)
        one_row = f"({', '.join('?' for _ in names)})"
        per_statement = max(1, _MAX_VARIABLES // width)
        for start in range(0, count, per_statement):
            rows = min(per_statement, count - start)
            sql = f'INSERT INTO "{table.name}" ({quoted}) VALUES {",".join([one_row] * rows)}'
            cursor = await driver.execute(sql, flat[start * width : (start + rows) * width])
            await cursor.close()

    def among(self, column: ColumnElement[Any], values: Sequence[str]) -> ColumnElement[bool]:
        """The values as one JSON array, unpacked by ``json_each`` (SQLite's JSON functions are
        built in since 3.38, and compiled in by default before): the lookups stay index
        probes."""
        names = bindparam(None, orjson.dumps(list(values)).decode(), type_=Text)
        return column.in_(select(literal_column("value")).select_from(func.json_each(names)))

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


def _run_whole(engine: Engine, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """Run ``fn`` in one transaction of ``engine``: its awaits of the connection complete at
    once (``_NowConnection``), so the coroutine finishes on its first step."""
    with engine.begin() as conn:
        step = fn(cast(AsyncConnection, _NowConnection(conn))).__await__()
        try:
            step.send(None)
        except StopIteration as finished:
            return cast(T, finished.value)
        step.close()
        raise CatalogError("a one-hop catalog write awaited something else than its connection")


class _NowConnection:
    """The part of ``AsyncConnection`` the catalog's row functions use, over a synchronous
    connection: each call is done by the time it is awaited."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        return self._conn.execute(statement, parameters)

    async def get_raw_connection(self) -> Any:
        return _NowRaw(self._conn.connection.dbapi_connection)


class _NowRaw:
    """``get_raw_connection()``'s result: ``driver_connection`` as aiosqlite's, over sqlite3."""

    def __init__(self, dbapi: Any) -> None:
        self.driver_connection = self
        self._dbapi = dbapi

    async def execute(self, sql: str, parameters: Sequence[Any] = ()) -> _NowCursor:
        return _NowCursor(self._dbapi.execute(sql, parameters))


class _NowCursor:
    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    async def close(self) -> None:
        self._cursor.close()


async def _checkpoint_wal(engine: AsyncEngine) -> None:
    try:
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver: Any = raw.driver_connection
            cursor = await driver.execute("PRAGMA wal_checkpoint(PASSIVE)")
            await cursor.close()
    except Exception:  # maintenance only: the automatic checkpoint still bounds the WAL
        logger.warning("background WAL checkpoint of the catalog failed", exc_info=True)


def _on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to _on_begin: pysqlite's own implicit BEGIN comes too late
    # (only before DML), which would let a transaction read before it holds the write lock.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        for pragma in _PRAGMAS:
            _execute_while_locked(cursor, pragma)
    finally:
        cursor.close()


def _execute_while_locked(cursor: Any, statement: str) -> None:
    """Run ``statement``, waiting out the lock SQLite may refuse without calling its busy handler:
    switching a brand-new file to WAL while other connections open it (concurrent first
    starts). Only connection setup comes here, and only on a file being created."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute(statement)
            return
        except Exception as e:  # sqlite3's, or SQLAlchemy's aiosqlite adapter's OperationalError
            if "locked" not in str(e).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _on_begin(conn: Connection) -> None:
    read_only = conn.get_execution_options().get(_READ_ONLY, False)
    conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
