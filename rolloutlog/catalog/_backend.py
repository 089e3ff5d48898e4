"""What differs between the catalog's databases, behind one small interface.

``open_catalog`` picks the subclass by URL (``_registry.backend_for``, which imports the chosen
module only); everything else in the catalog is shared SQL. A backend creates the engines, bulk-inserts rows through the raw driver
(the one hot path: a 16,000-entry manifest is one ``executemany``/``COPY``, not 16,000 round
trips), serializes migrations and classifies driver errors into rolloutlog's error tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from sqlalchemy import ColumnElement, Table
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rolloutlog.catalog._turns import WriteTurns
from rolloutlog.errors import (
    BackendUnavailable,
    CatalogError,
    CheckpointInProgress,
    RolloutlogError,
)

ONE_PENDING_INDEX = "uq_checkpoints_one_pending"

T = TypeVar("T")


class Backend:
    """Base of the per-database overrides."""

    name: ClassVar[str]

    def __init__(self, url: str) -> None:
        self.url = url

    def create_engine(self) -> AsyncEngine:
        raise NotImplementedError

    def read_engine(self, engine: AsyncEngine) -> AsyncEngine:
        """An engine over the same pool whose transactions read one consistent snapshot."""
        raise NotImplementedError

    async def bulk_insert(
        self,
        conn: AsyncConnection,
        table: Table,
        names: Sequence[str],
        columns: Sequence[Sequence[Any]],
    ) -> None:
        """Insert rows given column-wise (``columns[i]`` holds column ``names[i]`` of every row)
        inside ``conn``'s open transaction."""
        raise NotImplementedError

    def among(self, column: ColumnElement[Any], values: Sequence[str]) -> ColumnElement[bool]:
        """``column IN values`` with every value in one bound parameter: a restore's commit
        names 16,000 episodes, and SQLAlchemy's expanding ``IN`` spent ~50 ms (SQLite) to
        ~110 ms (PostgreSQL) rendering and binding them one by one, and needed batches under
        the database's parameter limit."""
        raise NotImplementedError

    async def join_by_hash(self, conn: AsyncConnection, on: bool) -> None:
        """From now on in ``conn``'s transaction (``on``), or no longer, join without nested
        loops where the database would choose them (a no-op where it plans no such join)."""

    #: Whether ``write_in_one_hop`` can run a write transaction.
    one_hop_writes: ClassVar[bool] = False

    async def write_in_one_hop(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run the write transaction ``fn`` whole on a worker thread: one trip through the
        event loop instead of one per statement (under load, each waits for the loop's turn).
        ``fn`` may await only ``conn``'s calls."""
        raise NotImplementedError

    def write_turns(self) -> WriteTurns | None:
        """Turns the catalog's writers take in this process, or None where the database
        queues writers itself."""
        return None

    def after_bulk_commit(self, engine: AsyncEngine) -> None:
        """Called after a large write committed: room for maintenance kept off its latency."""

    async def close(self) -> None:
        """Finish background work; called before the engine is disposed."""

    async def lock_migrations(self, conn: AsyncConnection) -> None:
        """Serialize concurrent starts that migrate the same catalog (no-op where writes serialize)."""

    async def now(self, conn: AsyncConnection, clock: Callable[[], float]) -> float:
        """The lease clock, read in ``conn``'s transaction: one clock for every replica's
        heartbeat. Here the process's ``clock`` (where every replica runs on one host)."""
        return clock()

    async def serialize_lease_changes(self, conn: AsyncConnection) -> None:
        """Lease changes one at a time until ``conn``'s transaction ends, so that two ticks
        never decide on the same snapshot (no-op where writes serialize already)."""

    def driver_errors(self) -> tuple[type[BaseException], ...]:
        """Exception classes of the driver that ``translate`` understands."""
        return ()

    def classify(self, error: BaseException) -> RolloutlogError | None:
        """The rolloutlog error for one driver exception, or None to fall back to ``CatalogError``."""
        return None

    def translate(self, error: BaseException) -> RolloutlogError:
        """Translate a driver or SQLAlchemy exception (the caller raises it ``from error``)."""
        if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
            return BackendUnavailable(
                f"catalog connection lost: {_first_line(error)}", backend=self.name
            )
        for cause in _causes(error):
            if isinstance(cause, sa_exc.TimeoutError | asyncio.TimeoutError | OSError):
                return BackendUnavailable(
                    f"catalog unreachable: {type(cause).__name__}: {_first_line(cause)}",
                    backend=self.name,
                )
            found = self.classify(cause)
            if found is not None:
                return found
        if isinstance(error, sa_exc.InterfaceError):
            return BackendUnavailable(
                f"catalog unreachable: {_first_line(error)}", backend=self.name
            )
        if isinstance(error, sa_exc.IntegrityError):
            return integrity_error(error)
        return CatalogError(
            f"catalog failed: {type(error).__name__}: {_first_line(error)}", backend=self.name
        )


def integrity_error(error: BaseException) -> RolloutlogError:
    """Integrity conflicts the catalog's own checks did not pre-empt (a race they lost)."""
    text = str(error)
    # PostgreSQL names the index; SQLite names the indexed column (and only that one).
    if ONE_PENDING_INDEX in text or text.rstrip().endswith(
        "UNIQUE constraint failed: checkpoints.run"
    ):
        return CheckpointInProgress("another checkpoint of this run is pending")
    return CatalogError(f"catalog integrity conflict: {_first_line(error)}")


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps (SQLAlchemy's ``orig``, the adapter's ``__cause__``)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        orig = getattr(current, "orig", None)
        todo.append(orig if isinstance(orig, BaseException) else None)
        todo.append(current.__cause__)
    return seen


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error)
    return text.splitlines()[0] if text else type(error).__name__
