"""The catalog's transactions: how each operation gets its one connection (docs/design.md §5).

``CatalogTransactions`` holds the engines and opens the read and write transactions every
operation runs in, translating driver errors into rolloutlog's at that one boundary. The
operations, grouped by what they serve, are its subclasses (``_run_ops.py``,
``_checkpoint_ops.py``, ``_restore_ops.py``, ``_result_ops.py``, ``_lease_ops.py``);
``Catalog`` (``_catalog.py``) composes them and adds the lifecycle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, nullcontext
from typing import TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rolloutlog.catalog import _migrate
from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._validate import check_count
from rolloutlog.catalog._values import DEFAULT_KEEP_COMMITTED
from rolloutlog.errors import CatalogError, RolloutlogError

T = TypeVar("T")


class CatalogTransactions:
    """The SQL catalog's engines and transactions (the base of ``Catalog``'s operations)."""

    def __init__(
        self,
        backend: Backend,
        *,
        keep_committed: int = DEFAULT_KEEP_COMMITTED,
        abort_pending_on_start: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_count(keep_committed, "keep_committed", minimum=1)
        self._backend = backend
        self._keep_committed = keep_committed
        self._abort_pending_on_start = abort_pending_on_start
        self._clock = clock
        self._engine: AsyncEngine | None = None
        self._reader: AsyncEngine | None = None
        #: Transactions open now: ``stop`` lets them end before it closes their connections.
        self._open = 0
        self._none_open = asyncio.Event()
        self._none_open.set()
        #: SQLite: writers take turns in the process, not by polling the database's lock.
        self._turns = backend.write_turns()
        self._translated: tuple[type[BaseException], ...] = (
            sa_exc.SQLAlchemyError,
            OSError,
            TimeoutError,
            *backend.driver_errors(),
        )
        self.migrated_from: str | None = None
        """The schema revision the last ``start()`` found (None: the database was empty)."""

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._backend.name

    @property
    def keep_committed(self) -> int:
        return self._keep_committed

    @contextmanager
    def _call(self, engine: AsyncEngine | None) -> Iterator[AsyncEngine]:
        """One call's span over ``engine``: refused unless the catalog is started, counted for
        ``stop``, its driver errors translated."""
        if engine is None:
            raise CatalogError("the catalog is not started")
        with self._translating():
            self._open += 1
            self._none_open.clear()
            try:
                yield engine
            finally:
                self._open -= 1
                if not self._open:
                    self._none_open.set()

    @contextmanager
    def _translating(self) -> Iterator[None]:
        """Driver and SQLAlchemy errors raised inside become rolloutlog's (``Backend.translate``,
        raised ``from`` the original)."""
        try:
            yield
        except RolloutlogError:
            raise
        except self._translated as e:
            raise self._backend.translate(e) from e

    def _turn(self, *, urgent: bool) -> AbstractAsyncContextManager[None]:
        """This process's write turn where the backend has turns (``Backend.write_turns``)."""
        return self._turns.turn(urgent=urgent) if self._turns is not None else nullcontext()

    def _after_bulk_commit(self) -> None:
        if self._engine is not None:
            self._backend.after_bulk_commit(self._engine)

    async def schema_revision(self) -> str | None:
        """The schema revision the database is at."""
        async with self._read() as conn:
            return await conn.run_sync(_migrate.current_revision)

    @asynccontextmanager
    async def _write(self, *, urgent: bool = False) -> AsyncIterator[AsyncConnection]:
        """A write transaction; ``urgent`` (a checkpoint's) goes before other waiting writers."""
        with self._call(self._engine) as engine:
            async with self._turn(urgent=urgent), engine.begin() as conn:
                yield conn

    async def _urgent_write(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """A checkpoint's write transaction: ``_write(urgent=True)``, run in one hop where the
        backend can (``Backend.write_in_one_hop``)."""
        if not self._backend.one_hop_writes:
            async with self._write(urgent=True) as conn:
                return await fn(conn)
        with self._call(self._engine):
            async with self._turn(urgent=True):
                return await self._backend.write_in_one_hop(fn)

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        with self._call(self._reader) as reader:
            async with reader.begin() as conn:
                yield conn

    async def _query(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        async with self._read() as conn:
            return await fn(conn)
