"""Restores: the catalog's operations that commit them, plan them per partition owner and
read them back (``Catalog`` composes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutlog.catalog import _reads, _restore_requests, _results
from rolloutlog.catalog._restore_commit import check_plan, commit_restore_rows, reserve_restore_id
from rolloutlog.catalog._restore_requests import RestorePart, RestorePlanning
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import check_count, check_positive_seconds, check_timings
from rolloutlog.catalog._values import Restore, RestoreAction, RestoreEntry


class RestoreOperations(CatalogTransactions):
    """``Catalog``'s operations on restores, committed and planned per partition owner."""

    async def commit_restore(
        self,
        run: str,
        controller_epoch: int,
        checkpoint_id: int,
        entries: Sequence[RestoreEntry],
        *,
        timings_ms: Mapping[str, float] | None = None,
        restore_id: int | None = None,
        fences: Mapping[str, Mapping[int, int]] | None = None,
    ) -> Restore:
        """Commit a restore plan and make its new attempts current, in one transaction.

        ``restore_id``, when given, must come from ``reserve_restore_id`` and be above every
        committed restore's id (``RestoreConflict`` otherwise): a caller that wrote log records
        naming the id before committing needs it.

        ``fences`` (with the ``restore_id`` of an ``open_restore`` request): per replica, the
        lease generation of each partition whose part it planned. The request must still be
        planning (``RestoreConflict``) and every replica must still hold its partitions at
        those generations (``LeaseLost``); the request commits with the restore.

        The checkpoint must be committed (else ``UnknownCheckpoint``). The plan must account for
        every ``continue``/``restart`` episode of its manifest exactly once, continue only
        episodes of the manifest (others, begun after its markers, may be restarted or
        excluded), never continue a finished or restart-only episode, and start from each
        episode's current attempt.
        """
        check_timings(timings_ms)
        check_plan(entries)
        now = self._clock()
        async with self._write() as conn:
            if fences is not None:
                assert restore_id is not None, "a request's restore commits under its id"
                await _restore_requests.lock_for_commit(conn, run, restore_id, fences)
            restore = await commit_restore_rows(
                conn,
                self._backend,
                run=run,
                controller_epoch=controller_epoch,
                checkpoint_id=checkpoint_id,
                entries=entries,
                timings_ms=dict(timings_ms or {}),
                now=now,
                restore_id=restore_id,
            )
            if fences is not None:
                await _restore_requests.end_request(
                    conn, run, restore.restore_id, "committed", now, None
                )
            await _results.drop_abandoned(
                conn, self._backend, run, [e.episode for e in entries if e.action != "excluded"]
            )
            unacknowledged = await _results.count_unacknowledged(conn, run)
        self._after_bulk_commit()
        return dataclasses.replace(restore, unacknowledged_results=unacknowledged)

    async def reserve_restore_id(self, run: str, controller_epoch: int) -> int:
        """Reserve the run's next restore id (``StaleController`` unless ``controller_epoch`` is
        current). A reserved id is never handed out again, committed or not."""
        async with self._write() as conn:
            return await reserve_restore_id(conn, run, controller_epoch)

    async def open_restore(
        self,
        run: str,
        controller_epoch: int,
        checkpoint_id: int,
        *,
        requested_by: str,
        request: Mapping[str, Any],
        deadline_s: float,
    ) -> int:
        """Reserve the run's next restore id (``reserve_restore_id``) and open its request
        (``planning`` until ``commit_restore(fences=…)`` or an abort; any replica may abort it
        ``deadline_s`` from now). Returns the id."""
        check_positive_seconds(deadline_s, "deadline_s")
        now = self._clock()
        async with self._write() as conn:
            return await _restore_requests.open_request(
                conn,
                run=run,
                controller_epoch=controller_epoch,
                checkpoint_id=checkpoint_id,
                requested_by=requested_by,
                request=request,
                now=now,
                deadline_at=now + deadline_s,
            )

    async def write_restore_parts(
        self,
        run: str,
        restore_id: int,
        replica_id: str,
        generations: Mapping[int, int],
        bodies: Mapping[int, Any],
    ) -> None:
        """Store a replica's plan part per partition (``bodies``: JSON-able) of a request still
        planning (``RestoreConflict`` otherwise), fenced by its lease ``generations``
        (``LeaseLost``; a partition without one is not fenced)."""
        async with self._write() as conn:
            await _restore_requests.write_parts(
                conn,
                run=run,
                restore_id=restore_id,
                replica_id=replica_id,
                generations=generations,
                bodies=bodies,
                now=self._clock(),
            )

    async def restore_parts(self, run: str, restore_id: int) -> list[RestorePart]:
        """A request's parts written so far, by partition."""
        return await self._query(lambda conn: _restore_requests.read_parts(conn, run, restore_id))

    async def planning_restores(self, run: str | None = None) -> list[RestorePlanning]:
        """Requests still planning: of one run, or of every run (one query)."""
        return await self._query(lambda conn: _restore_requests.planning_requests(conn, run))

    async def get_restore_request(self, run: str, restore_id: int) -> RestorePlanning:
        return await self._query(lambda conn: _restore_requests.get_request(conn, run, restore_id))

    async def abort_restore(self, run: str, restore_id: int, reason: str) -> bool:
        """Abort a request still planning; False when it had ended already."""
        async with self._write() as conn:
            return await _restore_requests.abort_request(
                conn, run, restore_id, self._clock(), reason
            )

    async def abort_expired_restores(self) -> int:
        """Abort every request still planning past its deadline (any replica sweeps)."""
        async with self._write() as conn:
            return await _restore_requests.abort_expired(conn, self._clock())

    async def get_restore(self, run: str, restore_id: int) -> Restore:
        return await self._query(lambda conn: _reads.get_restore(conn, run, restore_id))

    async def list_restores(
        self, run: str, *, before: int | None = None, limit: int = 100
    ) -> list[Restore]:
        """Restores newest first; page with ``before=<last restore id>``."""
        check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.list_restores(conn, run, before, limit))

    async def restore_episodes(
        self,
        run: str,
        restore_id: int,
        *,
        action: RestoreAction | None = None,
        after: str | None = None,
        limit: int | None = 1000,
    ) -> list[RestoreEntry]:
        """A restore's episodes by episode id; page with ``after``; ``limit=None`` for all."""
        if limit is not None:
            check_count(limit, "limit", minimum=1)
        return await self._query(
            lambda conn: _reads.restore_entries(conn, run, restore_id, action, after, limit)
        )
