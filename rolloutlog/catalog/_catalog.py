"""The catalog: every durable decision of the service, one transaction per operation.

Writes that touch a run's fencing state (controller takeover, every checkpoint and restore step)
first lock the run's row, so they serialize per run on either database and each check of the
controller epoch holds until its transaction commits.

``Catalog`` is its operations, grouped by what they serve (runs, checkpoints, restores,
results, leases and the controller: one module each), over the transactions of
``_transactions.py``; this module adds the lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

from rolloutlog.catalog import _migrate
from rolloutlog.catalog._checkpoint_ops import CheckpointOperations
from rolloutlog.catalog._fork_ops import ForkOperations
from rolloutlog.catalog._lease_ops import LeaseOperations
from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._restore_ops import RestoreOperations
from rolloutlog.catalog._result_ops import ResultOperations
from rolloutlog.catalog._run_ops import RunOperations

#: How long ``Catalog.stop`` lets the transactions already open end.
STOP_WAIT_S = 5.0


class Catalog(
    RunOperations,
    CheckpointOperations,
    RestoreOperations,
    ResultOperations,
    LeaseOperations,
    ForkOperations,
):
    """The SQL catalog of one deployment. Use ``async with`` or ``start()``/``stop()``."""

    async def start(self) -> None:
        """Connect, migrate the schema to this code's head, abort checkpoints left pending."""
        if self._engine is not None:
            return
        engine = self._backend.create_engine()
        try:
            with self._translating():
                async with engine.begin() as conn:
                    await self._backend.lock_migrations(conn)
                    before, _ = await conn.run_sync(_migrate.upgrade)
            self.migrated_from = before
            self._engine = engine
            self._reader = self._backend.read_engine(engine)
            if self._abort_pending_on_start:
                await self.abort_pending_checkpoints("aborted on start: left pending by a crash")
        except BaseException:
            self._engine = self._reader = None
            await engine.dispose()
            raise

    async def stop(self) -> None:
        """Close every connection; the catalog can be started again.

        New calls fail at once (``the catalog is not started``); the transactions already
        open are given ``STOP_WAIT_S`` to end, so that no connection is disposed of while a
        call still uses it (it would be dropped unclosed)."""
        engine, self._engine, self._reader = self._engine, None, None
        if engine is not None:
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOP_WAIT_S):
                        await self._none_open.wait()
                await self._backend.close()
            finally:
                await engine.dispose()

    async def __aenter__(self) -> Catalog:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def sibling(self) -> Catalog:
        """A catalog on the same database with its own connections (not started): the lease
        heartbeat's, on its own thread and event loop."""
        return Catalog(
            backend_for(self._backend.url),
            keep_committed=self._keep_committed,
            abort_pending_on_start=False,
            clock=self._clock,
        )
