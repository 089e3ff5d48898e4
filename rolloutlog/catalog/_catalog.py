"""The catalog: every durable decision of the service, one transaction per operation.

Writes that touch a run's fencing state (controller takeover, every checkpoint and restore step)
first lock the run's row, so they serialize per run on either database and each check of the
controller epoch holds until its transaction commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager, nullcontext
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rolloutlog.catalog import (
    _forks,
    _leases,
    _migrate,
    _reads,
    _requesters,
    _restore_requests,
    _results,
    _writes,
)
from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._leases import ClusterView, PartitionOwner
from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._restore_requests import RestorePart, RestorePlanning
from rolloutlog.catalog._schema import (
    checkpoints,
    runs,
)
from rolloutlog.catalog._validate import (
    check_count,
    check_episode,
    check_name,
    check_positive_seconds,
    check_run_name,
    check_timings,
)
from rolloutlog.catalog._values import (
    DEFAULT_KEEP_COMMITTED,
    DEFAULT_PARTITIONS,
    PARTICIPANT_KINDS,
    Checkpoint,
    CheckpointStatus,
    Episode,
    EpisodeFinish,
    EpisodeStart,
    EpisodeStatus,
    FinishedResult,
    ManifestAction,
    ManifestEntry,
    PartitionOffset,
    QuarantinedRecord,
    RegisteredParticipant,
    Restore,
    RestoreAction,
    RestoreEntry,
    Run,
    RunStats,
    RunSummary,
)
from rolloutlog.catalog._writes import (
    check_plan,
    commit_restore_rows,
    drop_checkpoint_parts,
    lock_run,
    quarantine_rows,
    reserve_restore_id,
    write_checkpoint_parts_rows,
)
from rolloutlog.errors import (
    CatalogError,
    CheckpointInProgress,
    CheckpointNotPending,
    InvalidRequest,
    RolloutlogError,
    RunExists,
    StaleController,
    UnknownCheckpoint,
)

T = TypeVar("T")

#: How long ``Catalog.stop`` lets the transactions already open end.
STOP_WAIT_S = 5.0

_REGISTER = text(
    "INSERT INTO participants (run, participant_id, kind, epoch, registered_at, last_seen_at) "
    "VALUES (:run, :participant_id, :kind, 1, :now, :now) "
    "ON CONFLICT (run, participant_id) DO UPDATE SET epoch = participants.epoch + 1, "
    "registered_at = excluded.registered_at, last_seen_at = excluded.last_seen_at "
    "WHERE participants.kind = excluded.kind "
    "RETURNING epoch"
)
_CREATE_RUN = text(
    "INSERT INTO runs (run, partitions, log_url, created_at) "
    "VALUES (:run, :partitions, :log_url, :now) ON CONFLICT (run) DO NOTHING"
)
_TOUCH = text(
    "UPDATE participants SET last_seen_at = CASE WHEN last_seen_at < :seen THEN :seen "
    "ELSE last_seen_at END WHERE run = :run AND participant_id = :participant_id"
)
_EPISODES_STARTED = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, first_partition, first_offset, "
    "started_at, updated_at) VALUES (:run, :episode, 0, 'running', :partition, :offset, "
    ":started_at, :now) ON CONFLICT (run, episode) DO UPDATE SET "
    "first_partition = COALESCE(episodes.first_partition, excluded.first_partition), "
    "first_offset = COALESCE(episodes.first_offset, excluded.first_offset), "
    "started_at = COALESCE(episodes.started_at, excluded.started_at), "
    "updated_at = excluded.updated_at"
)
# A finish of an attempt older than the current one (fenced) does not change the episode.
_EPISODES_FINISHED = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, finished_at, updated_at) "
    "VALUES (:run, :episode, :attempt, 'finished', :finished_at, :now) "
    "ON CONFLICT (run, episode) DO UPDATE SET status = 'finished', "
    "finished_at = COALESCE(episodes.finished_at, excluded.finished_at), "
    "updated_at = excluded.updated_at "
    "WHERE episodes.current_attempt <= excluded.current_attempt"
)


class Catalog:
    """The SQL catalog of one deployment. Use ``async with`` or ``start()``/``stop()``."""

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

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, migrate the schema to this code's head, abort checkpoints left pending."""
        if self._engine is not None:
            return
        engine = self._backend.create_engine()
        try:
            try:
                async with engine.begin() as conn:
                    await self._backend.lock_migrations(conn)
                    before, _ = await conn.run_sync(_migrate.upgrade)
            except RolloutlogError:
                raise
            except self._translated as e:
                raise self._backend.translate(e) from e
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

    @contextmanager
    def _counted(self) -> Iterator[None]:
        self._open += 1
        self._none_open.clear()
        try:
            yield
        finally:
            self._open -= 1
            if not self._open:
                self._none_open.set()

    def _after_bulk_commit(self) -> None:
        if self._engine is not None:
            self._backend.after_bulk_commit(self._engine)

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

    async def schema_revision(self) -> str | None:
        """The schema revision the database is at."""
        async with self._read() as conn:
            return await conn.run_sync(_migrate.current_revision)

    @asynccontextmanager
    async def _write(self, *, urgent: bool = False) -> AsyncIterator[AsyncConnection]:
        """A write transaction; ``urgent`` (a checkpoint's) goes before other waiting writers."""
        if self._engine is None:
            raise CatalogError("the catalog is not started")
        turns = self._turns
        try:
            with self._counted():
                async with (
                    turns.turn(urgent=urgent) if turns is not None else nullcontext(),
                    self._engine.begin() as conn,
                ):
                    yield conn
        except RolloutlogError:
            raise
        except self._translated as e:
            raise self._backend.translate(e) from e

    async def _urgent_write(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """A checkpoint's write transaction: ``_write(urgent=True)``, run in one hop where the
        backend can (``Backend.write_in_one_hop``)."""
        if not self._backend.one_hop_writes:
            async with self._write(urgent=True) as conn:
                return await fn(conn)
        if self._engine is None:
            raise CatalogError("the catalog is not started")
        turns = self._turns
        try:
            with self._counted():
                async with turns.turn(urgent=True) if turns is not None else nullcontext():
                    return await self._backend.write_in_one_hop(fn)
        except RolloutlogError:
            raise
        except self._translated as e:
            raise self._backend.translate(e) from e

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        if self._reader is None:
            raise CatalogError("the catalog is not started")
        try:
            with self._counted():
                async with self._reader.begin() as conn:
                    yield conn
        except RolloutlogError:
            raise
        except self._translated as e:
            raise self._backend.translate(e) from e

    async def _query(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        async with self._read() as conn:
            return await fn(conn)

    # -- runs and participants -----------------------------------------------------------------

    async def create_run(
        self, run: str, *, partitions: int | None = None, log_url: str | None = None
    ) -> Run:
        """Create a run, or return it if it exists with the same settings (else ``RunExists``).

        ``None`` settings mean "as stored" for an existing run and the defaults for a new one.
        """
        check_run_name(run)
        if partitions is not None:
            check_count(partitions, "partitions", minimum=1)
        if log_url is not None:
            check_name(log_url, "log_url")
        async with self._write() as conn:
            await conn.execute(
                _CREATE_RUN,
                {
                    "run": run,
                    "partitions": partitions if partitions is not None else DEFAULT_PARTITIONS,
                    "log_url": log_url,
                    "now": self._clock(),
                },
            )
            found = await _reads.get_run(conn, run)
        differs = {
            name: {"existing": existing, "requested": requested}
            for name, existing, requested in (
                ("partitions", found.partitions, partitions),
                ("log_url", found.log_url, log_url),
            )
            if requested is not None and requested != existing
        }
        if differs:
            raise RunExists(f"run {run!r} exists with other settings", run=run, settings=differs)
        return found

    async def get_run(self, run: str) -> Run:
        return await self._query(lambda conn: _reads.get_run(conn, run))

    async def run_summary(self, run: str) -> RunSummary:
        """One run with its counts."""

        async def query(conn: AsyncConnection) -> RunSummary:
            return (await _reads.summarize_runs(conn, [await _reads.get_run(conn, run)]))[0]

        return await self._query(query)

    async def list_runs(self, *, after: str | None = None, limit: int = 100) -> list[RunSummary]:
        """Runs with counts, by name; page with ``after=<last run's name>``."""
        check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.list_runs(conn, after, limit))

    async def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        """Register (or re-register) a participant; return its new epoch (1, 2, …)."""
        check_name(participant_id, "participant_id")
        if kind not in PARTICIPANT_KINDS:
            raise InvalidRequest(
                f"participant kind must be one of {sorted(PARTICIPANT_KINDS)}, not {kind!r}",
                field="kind",
            )
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            epoch = (
                await conn.execute(
                    _REGISTER,
                    {
                        "run": run,
                        "participant_id": participant_id,
                        "kind": kind,
                        "now": self._clock(),
                    },
                )
            ).scalar_one_or_none()
            if epoch is None:
                existing = await conn.execute(
                    text(
                        "SELECT kind FROM participants WHERE run = :run AND participant_id = :pid"
                    ),
                    {"run": run, "pid": participant_id},
                )
                raise InvalidRequest(
                    f"participant {participant_id!r} is registered as another kind",
                    field="kind",
                    registered_kind=existing.scalar_one(),
                )
            return int(epoch)

    async def touch_participants(self, run: str, seen: Mapping[str, float]) -> None:
        """Record when participants were last seen (never moves a time backwards)."""
        if not seen:
            return
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            await conn.execute(
                _TOUCH,
                [{"run": run, "participant_id": pid, "seen": at} for pid, at in seen.items()],
            )

    async def list_participants(self, run: str) -> list[RegisteredParticipant]:
        return await self._query(lambda conn: _reads.list_participants(conn, run))

    # -- fencing -------------------------------------------------------------------------------

    async def take_over_controller(self, run: str, *, expected_epoch: int | None = None) -> int:
        """Become the run's controller; return the new controller epoch.

        With ``expected_epoch`` this is a compare-and-set: it fails with ``StaleController`` unless
        the current epoch is still ``expected_epoch``, so of two takeovers that saw the same epoch
        exactly one wins. Checkpoints left pending by the previous controller are aborted.
        """
        async with self._write() as conn:
            row = await lock_run(conn, run)
            current = int(row.controller_epoch)
            if expected_epoch is not None and expected_epoch != current:
                raise StaleController(
                    f"controller epoch of run {run!r} is {current}, not {expected_epoch}",
                    run=run,
                    expected_epoch=expected_epoch,
                    current_epoch=current,
                )
            new_epoch = current + 1
            await conn.execute(
                update(runs).where(runs.c.run == run).values(controller_epoch=new_epoch)
            )
            aborted = await conn.execute(
                update(checkpoints)
                .where(checkpoints.c.run == run, checkpoints.c.status == "pending")
                .values(
                    status="aborted",
                    ended_at=self._clock(),
                    reason=f"controller taken over by epoch {new_epoch}",
                )
                .returning(checkpoints.c.checkpoint_id)
            )
            for checkpoint_id in list(aborted.scalars()):
                await drop_checkpoint_parts(conn, run, checkpoint_id)
            return new_epoch

    # -- checkpoints ---------------------------------------------------------------------------

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
                gone = await _requesters.requester_gone(conn, self._clock, pending)
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
            await conn.execute(
                update(runs).where(runs.c.run == run).values(last_checkpoint_id=checkpoint_id)
            )
            await conn.execute(
                insert(checkpoints).values(
                    run=run,
                    checkpoint_id=checkpoint_id,
                    status="pending",
                    trigger=trigger,
                    controller_epoch=controller_epoch,
                    deadline_s=deadline_s,
                    requested_at=self._clock(),
                    requested_by=requested_by or None,
                    requester_started_at=started_at,
                    request_id=request_id,
                )
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
        committed = await self._write_parts(
            run,
            checkpoint_id,
            offsets,
            entries,
            replica_id="",
            generations={},
            controller_epoch=controller_epoch,
            timings_ms=timings_ms,
            marked_at=marked_at,
            base_checkpoint_id=base_checkpoint_id,
            removed=removed,
            totals=totals,
            whole=True,
        )
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
        return await self._write_parts(
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
            whole=False,
        )

    async def _write_parts(
        self,
        run: str,
        checkpoint_id: int,
        offsets: Sequence[PartitionOffset],
        entries: Sequence[ManifestEntry],
        *,
        replica_id: str,
        generations: Mapping[int, int],
        controller_epoch: int | None,
        timings_ms: Mapping[str, float] | None,
        marked_at: float | None,
        base_checkpoint_id: int | None,
        removed: Sequence[ManifestEntry],
        totals: Mapping[str, int] | None,
        whole: bool,
    ) -> Checkpoint | None:
        """The one transaction of both: ``whole``, a write that leaves a partition without its
        part is refused (and rolled back) instead of waiting for another writer's."""
        check_timings(timings_ms)

        async def write(conn: AsyncConnection) -> Checkpoint | None:
            committed = await write_checkpoint_parts_rows(
                conn,
                self._backend,
                run=run,
                checkpoint_id=checkpoint_id,
                replica_id=replica_id,
                generations=generations,
                controller_epoch=controller_epoch,
                offsets=offsets,
                entries=entries,
                timings_ms=dict(timings_ms or {}),
                marked_at=marked_at,
                now=self._clock(),
                keep_committed=self._keep_committed,
                base_checkpoint_id=base_checkpoint_id,
                removed=removed,
                totals=totals,
            )
            if committed is None and whole:
                raise InvalidRequest(
                    f"a checkpoint of run {run!r} needs one offset for each of its partitions",
                    field="offsets",
                    given=sorted(offset.partition for offset in offsets),
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
                conn, self._clock, reason, requested_by=requested_by
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
            lambda conn: _reads.manifest_page(conn, run, checkpoint_id, after, limit, action)
        )

    async def load_manifest(self, run: str, checkpoint_id: int) -> list[ManifestEntry]:
        """The whole manifest of a committed checkpoint, read in one snapshot."""
        return await self._query(
            lambda conn: _reads.manifest_page(conn, run, checkpoint_id, None, None)
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
        return await self._query(lambda conn: _reads.staging_keys(conn, run))

    # -- restores and episodes -----------------------------------------------------------------

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
                conn, run, [e.episode for e in entries if e.action != "excluded"]
            )
            unacknowledged = await _results.count_unacknowledged(conn, run)
        self._after_bulk_commit()
        return dataclasses.replace(restore, unacknowledged_results=unacknowledged)

    async def reserve_restore_id(self, run: str, controller_epoch: int) -> int:
        """Reserve the run's next restore id (``StaleController`` unless ``controller_epoch`` is
        current). A reserved id is never handed out again, committed or not."""
        async with self._write() as conn:
            return await reserve_restore_id(conn, run, controller_epoch)

    # -- restores planned per partition owner ------------------------------------

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

    async def record_episodes(
        self,
        run: str,
        started: Sequence[EpisodeStart] = (),
        finished: Sequence[EpisodeFinish] = (),
    ) -> None:
        """Record episodes' starts and finishes for analysts, as the projector folds them.

        Starts keep the first position and time recorded; a finish marks the episode
        ``finished`` unless a restore has made a newer attempt current. Attempts themselves are
        the restores' to set. (Checkpoint commits do not touch this table: keeping 16,000 rows
        of it current would double a commit's cost.)
        """
        if not started and not finished:
            return
        for start in started:
            check_episode(start.episode)
        for finish in finished:
            check_episode(finish.episode)
            check_count(finish.attempt, "attempt")
        now = self._clock()
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            if started:
                await conn.execute(
                    _EPISODES_STARTED,
                    [
                        {
                            "run": run,
                            "episode": start.episode,
                            "partition": start.partition,
                            "offset": start.offset,
                            "started_at": start.started_at,
                            "now": now,
                        }
                        for start in started
                    ],
                )
            if finished:
                await conn.execute(
                    _EPISODES_FINISHED,
                    [
                        {
                            "run": run,
                            "episode": finish.episode,
                            "attempt": finish.attempt,
                            "finished_at": finish.finished_at,
                            "now": now,
                        }
                        for finish in finished
                    ],
                )
                await _results.record(conn, run, finished, now)

    # -- results ---------------------------------------------------------------------

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

    # -- quarantine ----------------------------------------------------------------------------

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

    async def get_episode(self, run: str, episode: str) -> Episode:
        return await self._query(lambda conn: _reads.get_episode(conn, run, episode))

    async def list_episodes(
        self,
        run: str,
        *,
        status: EpisodeStatus | None = None,
        after: str | None = None,
        limit: int = 1000,
    ) -> list[Episode]:
        """Episodes by id, optionally of one status; page with ``after=<last episode>``."""
        check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.list_episodes(conn, run, status, after, limit))

    async def current_attempts(self, run: str) -> dict[str, int]:
        """Every recorded episode's current attempt (episodes absent here are at attempt 0)."""
        return await self._query(lambda conn: _reads.current_attempts(conn, run))

    async def run_stats(self, run: str) -> RunStats:
        return await self._query(lambda conn: _reads.run_stats(conn, run))

    # -- forks (``_forks.py``) -------------------------------------------------------------------

    async def claim_fork(
        self,
        run: str,
        *,
        source: str,
        checkpoint_id: int,
        partitions: int,
        log_url: str | None,
        request: dict[str, Any],
    ) -> _forks.ForkClaim:
        """Claim ``run`` for a fork of ``source``'s checkpoint (``_forks.claim``)."""
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
            )

    async def commit_fork(
        self,
        run: str,
        offsets: Sequence[PartitionOffset],
        entries: Sequence[ManifestEntry],
        first_offsets: dict[str, int],
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
            )

        created = await self._urgent_write(write)
        self._after_bulk_commit()
        return created

    async def release_fork(self, run: str) -> bool:
        """Drop the claim of a fork that was not created (``_forks.release``)."""
        async with self._write() as conn:
            return await _forks.release(conn, run)

    async def forks_of(self, run: str) -> list[Run]:
        """The forks created from ``run``, oldest first."""
        return await self._query(lambda conn: _forks.forks_of(conn, run))

    # -- run deletion (helper ``embedded``) -------------------------------------------------------

    async def delete_run(self, run: str) -> None:
        """Delete the run and every row that belongs to it, in one transaction (``UnknownRun``
        when there is no such run); the name can be created afresh."""
        check_run_name(run)
        async with self._write() as conn:
            await _writes.delete_run_rows(conn, run)

    # -- partition leases (``_leases.py``) --------------------------------------------

    async def lease_tick(
        self,
        replica_id: str,
        *,
        lease_s: float,
        held: Mapping[str, Mapping[int, int]],
        address: str | None = None,
        fresh: bool = False,
        health: str | None = None,
    ) -> dict[str, dict[int, int]]:
        """Renew the replica's heartbeat and move its leases towards the balanced assignment;
        return the partitions it owns (run -> partition -> generation). ``held``: what its
        previous tick returned; ``fresh``: the process's first tick; ``health``: its report
        (JSON) for ``cluster_view``."""
        check_name(replica_id, "replica_id")
        check_positive_seconds(lease_s, "lease_s")
        async with self._write() as conn:
            return await _leases.tick(
                conn,
                self._clock,
                replica_id,
                address=address,
                lease_s=lease_s,
                held=held,
                fresh=fresh,
                health=health,
            )

    async def cluster_view(self, run: str | None = None) -> ClusterView:
        """Every run's (or one run's) leases with their owners' heartbeats and reports."""
        return await self._query(lambda conn: _leases.cluster_view(conn, self._clock, run))

    def sibling(self) -> Catalog:
        """A catalog on the same database with its own connections (not started): the lease
        heartbeat's, on its own thread and event loop."""
        return Catalog(
            backend_for(self._backend.url),
            keep_committed=self._keep_committed,
            abort_pending_on_start=False,
            clock=self._clock,
        )

    async def release_leases(self, replica_id: str) -> None:
        """The replica stops: its partitions are released and its heartbeat ends now."""
        async with self._write() as conn:
            await _leases.release_replica(conn, self._clock, replica_id)

    async def partition_owners(self, run: str) -> list[PartitionOwner]:
        """Each partition of the run with its owner and generation (``UnknownRun``)."""

        async def query(conn: AsyncConnection) -> list[PartitionOwner]:
            info = await _reads.get_run(conn, run)
            return await _leases.partition_owners(conn, self._clock, run, info.partitions)

        return await self._query(query)

    # -- one episode's history (read-only) ----------------------------------------

    async def episode_plan_entries(self, run: str, episode: str) -> list[tuple[int, RestoreEntry]]:
        """``(restore_id, entry)`` of every restore whose plan names the episode, oldest first."""
        check_episode(episode)
        return await self._query(lambda conn: _reads.episode_plan_entries(conn, run, episode))

    async def episode_manifest_entries(
        self, run: str, episode: str, partition: int
    ) -> list[tuple[int, ManifestEntry]]:
        """``(checkpoint_id, entry)`` of every kept committed manifest naming the episode (which
        lives in ``partition``), oldest first."""
        check_episode(episode)
        return await self._query(
            lambda conn: _reads.episode_manifest_entries(conn, run, episode, partition)
        )


async def _checkpoint_status(conn: AsyncConnection, run: str, checkpoint_id: int) -> str:
    status = (
        await conn.execute(
            select(checkpoints.c.status).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).scalar_one_or_none()
    if status is None:
        raise UnknownCheckpoint(
            f"run {run!r} has no checkpoint {checkpoint_id}", run=run, checkpoint_id=checkpoint_id
        )
    return str(status)


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
