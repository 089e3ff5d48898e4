"""Forks: the catalog's operations on them (``Catalog`` composes them; the transactions are
``_forks.py``'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _forks
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import check_run_name
from rolloutlog.catalog._values import ManifestEntry, PartitionOffset, Run


class ForkOperations(CatalogTransactions):
    async def claim_fork(
        self,
        run: str,
        *,
        source: str,
        checkpoint_id: int,
        partitions: int,
        log_url: str | None,
        request: dict[str, Any],
        claimed_by: str | None = None,
    ) -> _forks.ForkClaim:
        """Claim ``run`` for a fork of ``source``'s checkpoint for the replica ``claimed_by``
        (``_forks.claim``)."""
        check_run_name(run)
        async with self._write() as conn:
            return await _forks.claim(
                conn,
                run,
                source=source,
                checkpoint_id=checkpoint_id,
                partitions=partitions,
                log_url=log_url,
                request=request,
                now=self._clock(),
                backend=self._backend,
                clock=self._clock,
                claimed_by=claimed_by,
            )

    async def commit_fork(
        self,
        run: str,
        offsets: Sequence[PartitionOffset],
        entries: Sequence[ManifestEntry],
        first_offsets: dict[str, int],
        claimed_by: str | None = None,
    ) -> Run:
        """Create the claimed fork ``run`` whole, in one transaction (``_forks.commit``)."""

        async def write(conn: AsyncConnection) -> Run:
            return await _forks.commit(
                conn,
                self._backend,
                run,
                offsets=offsets,
                entries=entries,
                first_offsets=first_offsets,
                now=self._clock(),
                keep_committed=self._keep_committed,
                claimed_by=claimed_by,
            )

        created = await self._urgent_write(write)
        self._after_bulk_commit()
        return created

    async def release_fork(self, run: str, claimed_by: str | None = None) -> bool:
        """Drop the claim of a fork that was not created, if ``claimed_by`` holds it
        (``_forks.release``)."""
        async with self._write() as conn:
            return await _forks.release(conn, run, claimed_by)

    async def forks_of(self, run: str) -> list[Run]:
        """The forks created from ``run``, oldest first."""
        return await self._query(lambda conn: _forks.forks_of(conn, run))
