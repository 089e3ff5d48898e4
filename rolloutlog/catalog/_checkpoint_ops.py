"""Checkpoints and their manifests: the catalog's operations that begin, commit (by
parts, the last writer's commits), abort and read them (``Catalog`` composes them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _manifests, _reads, _requesters
from rolloutlog.catalog._checkpoint_commit import CheckpointParts, write_checkpoint_parts_rows
from rolloutlog.catalog._schema import checkpoints
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import (
    check_count,
    check_name,
    check_positive_seconds,
    check_timings,
)
from rolloutlog.catalog._values import (
    Checkpoint,
    CheckpointStatus,
    ManifestAction,
    ManifestEntry,
    PartitionOffset,
)
from rolloutlog.catalog._writes import drop_checkpoint_parts, lock_run, open_checkpoint
from rolloutlog.errors import (
    CheckpointInProgress,
    CheckpointNotPending,
    InvalidRequest,
)


class CheckpointOperations(CatalogTransactions):
    """``Catalog``'s operations on checkpoints and their manifests."""

    async def begin_checkpoint(
        self,
        run: str,
        controller_epoch: int,
        *,
        trigger: str = "request",
        deadline_s: float | None = None,
        requested_by: str | None = None,
        request_id: str | None = None,
    ) -> int:
        """Create the run's one ``pending`` checkpoint; return its id (strictly increasing).
        ``requested_by``: the replica that asks (``_requesters.py``): a pending checkpoint whose
        requester is gone is aborted here, superseded, instead of refusing the request.
        ``request_id``: the client's id of the request, kept on the row
        (``checkpoint_of_request``); a request whose checkpoint committed is not begun again
        (``checkpoint_in_progress``: ``checkpoint_of_request`` answers it)."""
        check_name(trigger, "trigger", length=64)
        check_positive_seconds(deadline_s, "deadline_s")
        if request_id is not None:
            check_name(request_id, "request_id", length=64)

        async def begin(conn: AsyncConnection) -> int:
            row = await lock_run(conn, run, controller_epoch)
            checkpoint_id = int(row.last_checkpoint_id) + 1
            if request_id is not None:
                await _refuse_answered(conn, run, request_id)
            pending = (
                await conn.execute(
                    select(
                        checkpoints.c.checkpoint_id,
                        checkpoints.c.requested_by,
                        checkpoints.c.requester_started_at,
                    ).where(checkpoints.c.run == run, checkpoints.c.status == "pending")
                )
            ).one_or_none()
            if pending is not None:
                gone = await _requesters.requester_gone(conn, self._backend, self._clock, pending)
                if gone is None:
                    raise CheckpointInProgress(
                        f"checkpoint {pending.checkpoint_id} of run {run!r} is still pending",
                        run=run,
                        checkpoint_id=pending.checkpoint_id,
                    )
                await _requesters.supersede_orphan(
                    conn,
                    run,
                    pending.checkpoint_id,
                    f"superseded by checkpoint {checkpoint_id}: {gone}",
                    self._clock(),
                )
            started_at = await _requesters.requester_incarnation(conn, requested_by)
            await open_checkpoint(
                conn,
                run,
                checkpoint_id,
                trigger=trigger,
                controller_epoch=controller_epoch,
                deadline_s=deadline_s,
                requested_at=self._clock(),
                requested_by=requested_by or None,
                requester_started_at=started_at,
                request_id=request_id,
            )
            return checkpoint_id

        return await self._urgent_write(begin)

    async def commit_checkpoint(
        self,
        run: str,
        checkpoint_id: int,
        controller_epoch: int,
        offsets: Sequence[PartitionOffset],
        entries: Sequence[ManifestEntry],
        *,
        timings_ms: Mapping[str, float] | None = None,
        marked_at: float | None = None,
        base_checkpoint_id: int | None = None,
        removed: Sequence[ManifestEntry] = (),
        totals: Mapping[str, int] | None = None,
    ) -> Checkpoint:
        """Commit a pending checkpoint manifest-last, in one transaction.

        Writes one offset per partition and every manifest entry, marks finished episodes,
        sets ``committed`` and the run's latest pointer, and applies retention: committed
        checkpoints beyond the newest ``keep_committed`` become ``expired`` and lose their
        manifest. A reader sees either none of it or all of it.

        With ``base_checkpoint_id`` (a retained committed checkpoint) the manifest is a delta:
        ``entries`` are those that differ from the base's manifest, ``removed`` the base's
        entries of episodes it no longer names, and ``totals`` (``continue``, ``restart``,
        ``finished``, ``size_bytes``) count the whole manifest. Reads compose the chain
        (docs/design.md, "Incremental manifests").
        """
        parts = CheckpointParts(
            run,
            checkpoint_id,
            offsets,
            entries,
            controller_epoch=controller_epoch,
            timings_ms=timings_ms,
            marked_at=marked_at,
            base_checkpoint_id=base_checkpoint_id,
            removed=removed,
            totals=totals,
        )
        committed = await self._write_parts(parts, whole=True)
        assert committed is not None  # ``whole``: every partition's part, or InvalidRequest
        return committed

    async def write_checkpoint_parts(
        self,
        run: str,
        checkpoint_id: int,
        offsets: Sequence[PartitionOffset],
        entries: Sequence[ManifestEntry],
        *,
        replica_id: str,
        generations: Mapping[int, int],
        controller_epoch: int | None = None,
        timings_ms: Mapping[str, float] | None = None,
        marked_at: float | None = None,
        base_checkpoint_id: int | None = None,
        removed: Sequence[ManifestEntry] = (),
        totals: Mapping[str, int] | None = None,
    ) -> Checkpoint | None:
        """Write one replica's parts of a pending checkpoint: the partitions of ``offsets``
        (exactly those of ``generations``, which ``check_leases`` fences: ``LeaseLost`` writes
        nothing; empty: not fenced), their manifest entries (whole, or a delta of
        ``base_checkpoint_id`` as for ``commit_checkpoint``, ``totals`` counting these
        partitions' whole manifest). When every partition of the run then has its part, the
        same transaction commits the checkpoint (counts summed over the writers') and returns
        it; else None: another writer's part commits it, or it aborts at its deadline."""
        parts = CheckpointParts(
            run,
            checkpoint_id,
            offsets,
            entries,
            replica_id=replica_id,
            generations=generations,
            controller_epoch=controller_epoch,
            timings_ms=timings_ms,
            marked_at=marked_at,
            base_checkpoint_id=base_checkpoint_id,
            removed=removed,
            totals=totals,
        )
        return await self._write_parts(parts, whole=False)

    async def _write_parts(self, parts: CheckpointParts, *, whole: bool) -> Checkpoint | None:
        """The one transaction of both: ``whole``, a write that leaves a partition without its
        part is refused (and rolled back) instead of waiting for another writer's."""
        check_timings(parts.timings_ms)

        async def write(conn: AsyncConnection) -> Checkpoint | None:
            committed = await write_checkpoint_parts_rows(
                conn,
                self._backend,
                parts,
                now=self._clock(),
                keep_committed=self._keep_committed,
            )
            if committed is None and whole:
                raise InvalidRequest(
                    f"a checkpoint of run {parts.run!r} needs one offset for each of its "
                    "partitions",
                    field="offsets",
                    given=sorted(offset.partition for offset in parts.offsets),
                )
            return committed

        committed = await self._urgent_write(write)
        self._after_bulk_commit()
        return committed

    async def written_parts(self, run: str, checkpoint_id: int) -> frozenset[int]:
        """The partitions a pending checkpoint has a part of already (by any writer)."""
        return await self._query(lambda conn: _reads.written_parts(conn, run, checkpoint_id))

    async def abort_checkpoint(
        self, run: str, checkpoint_id: int, controller_epoch: int, reason: str
    ) -> None:
        """Abort a pending checkpoint (aborting an aborted one again is a no-op)."""
        async with self._write() as conn:
            await lock_run(conn, run, controller_epoch)
            status = await _checkpoint_status(conn, run, checkpoint_id)
            if status == "aborted":
                return
            if status != "pending":
                raise CheckpointNotPending(
                    f"checkpoint {checkpoint_id} of run {run!r} is {status}; only a pending "
                    "checkpoint can be aborted",
                    run=run,
                    checkpoint_id=checkpoint_id,
                    status=status,
                )
            await conn.execute(
                update(checkpoints)
                .where(checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id)
                .values(status="aborted", ended_at=self._clock(), reason=reason)
            )
            await drop_checkpoint_parts(conn, run, checkpoint_id)

    async def abort_pending_checkpoints(
        self, reason: str, *, requested_by: str | None = None
    ) -> list[tuple[str, int]]:
        """Abort the pending checkpoints no live replica will finish; return their (run,
        checkpoint id): with ``requested_by``, that replica's (a process starting under its id:
        any earlier one is dead), else every one but those of a live requester (another replica's,
        ``_requesters.py``).

        ``start()`` calls this (unless ``abort_pending_on_start=False``): a checkpoint pending when
        the service died can never be committed, and it would block the run's next checkpoint.
        """
        async with self._write() as conn:
            return await _requesters.abort_orphans(
                conn, self._backend, self._clock, reason, requested_by=requested_by
            )

    async def abort_overdue_checkpoints(
        self, default_deadline_s: float, grace_s: float
    ) -> list[tuple[str, int]]:
        """Abort every checkpoint still pending ``grace_s`` past its deadline (``deadline_s``,
        else ``default_deadline_s``, from its request): whoever requested it is gone, and it
        would block its run's next checkpoint. Returns their (run, checkpoint id)."""
        deadline = func.coalesce(checkpoints.c.deadline_s, default_deadline_s)
        async with self._read() as conn:
            overdue = (
                await conn.execute(
                    select(checkpoints.c.run, checkpoints.c.checkpoint_id).where(
                        checkpoints.c.status == "pending",
                        checkpoints.c.requested_at + deadline + grace_s < self._clock(),
                    )
                )
            ).all()
        aborted = []
        for run, checkpoint_id in overdue:
            async with self._write() as conn:
                await lock_run(conn, run)
                if await _checkpoint_status(conn, run, checkpoint_id) != "pending":
                    continue  # committed or aborted meanwhile
                await conn.execute(
                    update(checkpoints)
                    .where(checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id)
                    .values(
                        status="aborted",
                        ended_at=self._clock(),
                        reason="aborted past its deadline: not every partition's part came",
                    )
                )
                await drop_checkpoint_parts(conn, run, checkpoint_id)
            aborted.append((str(run), int(checkpoint_id)))
        return aborted

    async def get_checkpoint(self, run: str, checkpoint_id: int) -> Checkpoint:
        return await self._query(lambda conn: _reads.get_checkpoint(conn, run, checkpoint_id))

    async def latest_checkpoint(self, run: str) -> Checkpoint:
        """The run's newest committed checkpoint (``UnknownCheckpoint`` if it has none)."""
        return await self._query(lambda conn: _reads.latest_checkpoint(conn, run))

    async def list_checkpoints(
        self,
        run: str,
        *,
        status: CheckpointStatus | None = None,
        before: int | None = None,
        limit: int = 100,
        request_id: str | None = None,
    ) -> list[Checkpoint]:
        """Checkpoints newest first; page with ``before=<last checkpoint id>``. ``request_id``:
        only those begun for that request (the newest answers it: the others were aborted)."""
        check_count(limit, "limit", minimum=1)
        return await self._query(
            lambda conn: _reads.list_checkpoints(conn, run, status, before, limit, request_id)
        )

    async def checkpoint_of_request(self, run: str, request_id: str) -> Checkpoint | None:
        """The checkpoint that answers the client's request ``request_id`` (the newest begun
        for it), or None when none was begun for it."""
        found = await self.list_checkpoints(run, limit=1, request_id=request_id)
        return found[0] if found else None

    async def manifest_page(
        self,
        run: str,
        checkpoint_id: int,
        *,
        after: str | None = None,
        limit: int = 1000,
        action: ManifestAction | None = None,
    ) -> list[ManifestEntry]:
        """Manifest entries by episode id; page with ``after=<last episode>``."""
        check_count(limit, "limit", minimum=1)
        return await self._query(
            lambda conn: _manifests.manifest_page(conn, run, checkpoint_id, after, limit, action)
        )

    async def load_manifest(self, run: str, checkpoint_id: int) -> list[ManifestEntry]:
        """The whole manifest of a committed checkpoint, read in one snapshot."""
        return await self._query(
            lambda conn: _manifests.manifest_page(conn, run, checkpoint_id, None, None)
        )

    async def stream_manifest(
        self, run: str, checkpoint_id: int, *, batch_size: int = 2000
    ) -> AsyncIterator[ManifestEntry]:
        """Iterate a manifest in batches, holding no connection between them.

        Each batch checks that the checkpoint is still committed, so a checkpoint that expires
        mid-stream raises ``UnknownCheckpoint`` instead of ending the stream early.
        """
        check_count(batch_size, "batch_size", minimum=1)
        after: str | None = None
        while True:
            batch = await self.manifest_page(run, checkpoint_id, after=after, limit=batch_size)
            for entry in batch:
                yield entry
            if len(batch) < batch_size:
                return
            after = batch[-1].episode

    async def staging_keys(self, run: str) -> frozenset[str]:
        """Staging keys referenced by the run's committed checkpoints (the trainer keeps them)."""
        return await self._query(lambda conn: _manifests.staging_keys(conn, run))


async def _checkpoint_status(conn: AsyncConnection, run: str, checkpoint_id: int) -> str:
    return str((await _reads.checkpoint_row(conn, run, checkpoint_id)).status)


async def _refuse_answered(conn: AsyncConnection, run: str, request_id: str) -> None:
    """``checkpoint_in_progress`` when request ``request_id``'s checkpoint committed (the
    request was sent again): that is the answer, not a new one. Its pending checkpoint is the
    run's one pending (refused, or superseded, as any); an aborted one begins again."""
    found = (
        await conn.execute(
            select(checkpoints.c.checkpoint_id, checkpoints.c.status)
            .where(checkpoints.c.run == run, checkpoints.c.request_id == request_id)
            .order_by(checkpoints.c.checkpoint_id.desc())
            .limit(1)
        )
    ).one_or_none()
    if found is not None and found.status in ("committed", "expired"):
        raise CheckpointInProgress(
            f"checkpoint {found.checkpoint_id} of run {run!r} answers request {request_id!r}: "
            f"it is {found.status}",
            run=run,
            checkpoint_id=found.checkpoint_id,
            request_id=request_id,
        )
