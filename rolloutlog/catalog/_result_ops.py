"""Finished episodes' results and the quarantined records: the catalog's operations on them
(``Catalog`` composes them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _reads, _results
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import check_count, check_episode
from rolloutlog.catalog._values import FinishedResult, QuarantinedRecord
from rolloutlog.catalog._writes import quarantine_rows


class ResultOperations(CatalogTransactions):
    """``Catalog``'s operations on finished episodes' results and quarantined records."""

    async def results_page(
        self,
        run: str,
        *,
        since_checkpoint: int | None = None,
        episodes: Collection[str] | None = None,
        unacknowledged: bool = False,
        after: str | None = None,
        limit: int | None = 1000,
    ) -> list[FinishedResult]:
        """Finished results by episode id (``UnknownRun``, ``UnknownCheckpoint``); page with
        ``after``. ``since_checkpoint``: finished at or past that checkpoint's markers."""
        if limit is not None:
            check_count(limit, "limit", minimum=1)
        for name in episodes or ():
            check_episode(name)

        async def query(conn: AsyncConnection) -> list[FinishedResult]:
            await _reads.get_run(conn, run)
            return await _results.page(
                conn,
                run,
                since_checkpoint=since_checkpoint,
                names=episodes,
                unacknowledged=unacknowledged,
                after=after,
                limit=limit,
            )

        return await self._query(query)

    async def acknowledge_results(self, run: str, episodes: Sequence[str]) -> tuple[int, list[str]]:
        """Record that the trainer holds these episodes' results: (how many were newly
        acknowledged, the episodes without a result). Idempotent."""
        for name in episodes:
            check_episode(name)
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            return await _results.acknowledge(conn, run, episodes, self._clock())

    async def result_episodes(self, run: str) -> set[str]:
        """Every episode whose result the catalog holds (acknowledged or not)."""
        return await self._query(lambda conn: _results.result_episodes(conn, run))

    async def quarantine(self, run: str, records: Sequence[QuarantinedRecord]) -> None:
        """Record log records the projector skipped (a record recorded before stays as it was)."""
        if records:
            async with self._write() as conn:
                await quarantine_rows(conn, run, records, self._clock())

    async def quarantined(
        self, run: str, *, after: tuple[int, int] | None = None, limit: int | None = 1000
    ) -> list[QuarantinedRecord]:
        """The run's quarantined records by (partition, offset); page with ``after``."""
        if limit is not None:
            check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.quarantined(conn, run, after, limit))
