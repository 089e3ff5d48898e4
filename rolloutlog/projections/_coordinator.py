"""The coordinator: one per service. It owns a projector per run (started on first use, fed to
the catalog by ``_feeders.py``) and hands checkpoints to ``_checkpointer.py`` and restores to
``_restorer.py`` (the runner; each owner's part planned by ``_part_planner.py`` with ``core``'s
pure planner, the projections served by ``_projection_server.py``). Its read doors answer the
API's questions about what the projectors track, so no other room reaches into projector state.

Each projector folds the partitions this replica owns (``_ownership.py``: catalog leases; a lone
replica owns them all). When a run's owned partitions or their generations change, its projector
is stopped and a new one started for the new set, rebuilt from the log as at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Unpack

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import Catalog, PartitionOwner
from rolloutlog.core import EpisodeProjection, RestorePolicy
from rolloutlog.errors import UnknownRun
from rolloutlog.log import Log, partition_for, record_episode
from rolloutlog.projections._checkpointer import (
    DEFAULT_WAIT_DEADLINE_S,
    Checkpointer,
    CheckpointOptions,
    CheckpointResult,
)
from rolloutlog.projections._feeders import flush_episodes, record_episodes, record_quarantine
from rolloutlog.projections._fork import ForkRequest, ForkResult, fork_run
from rolloutlog.projections._health import HealthReporter, RunHealth, RunHealthReport
from rolloutlog.projections._ownership import DEFAULT_LEASE_S, Ownership, default_replica_id
from rolloutlog.projections._part_planner import PartPlanner
from rolloutlog.projections._prepared import RestorePreparer
from rolloutlog.projections._projection_server import (
    ProjectionCache,
    ProjectionServer,
    RestoreLines,
    committed_checkpoint,
)
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._restorer import DEFAULT_RESTORE_DEADLINE_S, Restorer, RestoreResult
from rolloutlog.projections._start_plan import start_plan

logger = logging.getLogger(__name__)

__all__ = ["Coordinator", "TrackedEpisode"]

#: How long the service's start waits for its runs' projectors to catch up with their logs.
START_WAIT_S = 30.0
#: How long a request waits for a starting projector's first catch-up.
SETTLE_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class TrackedEpisode:
    """An episode as this service's projector tracks it (what the catalog may not know yet)."""

    episode: str
    attempt: int
    finished: bool
    first_partition: int
    first_offset: int | None
    started_at: float | None

    @property
    def status(self) -> Literal["running", "finished"]:
        return "finished" if self.finished else "running"


class Coordinator:
    """One per service: owns a projector per run and runs checkpoints and restores."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        *,
        projection_cache_bytes: int = 256 << 20,
        replica_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        address: str | None = None,
        restore_deadline_s: float = DEFAULT_RESTORE_DEADLINE_S,
    ):
        self.log = log
        self.catalog = catalog
        #: This replica's name in the catalog's leases (``default_replica_id()`` when not given).
        self.replica_id = replica_id or default_replica_id()
        self._ownership = Ownership(
            catalog,
            self.replica_id,
            lease_s=lease_s,
            address=address,
            on_change=self._owners_changed,
        )
        self.projectors: dict[str, Projector] = {}
        #: This replica's report for the others, and the runs' health across replicas.
        self.health_reporter = HealthReporter(
            log,
            self.projectors,
            catalog.cluster_view,
            self._ownership.publish,
            replica_id=self.replica_id,
            lease_s=lease_s,
        )
        self._run_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._start_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        #: Per run, the tasks that feed the catalog from its projector (ended with the run).
        self._recorders: dict[str, list[asyncio.Task[Any]]] = {}
        self._restore_cache = ProjectionCache(projection_cache_bytes)
        #: A committed checkpoint's lines, prepared for its restore within half that budget
        #: (they take the place of the run's cached ones).
        self.preparer = RestorePreparer(
            log, projection_cache_bytes // 2, superseded=self._restore_cache.forget_run
        )
        self._checkpointer = Checkpointer(
            log,
            catalog,
            self.projector,
            self._spawn,
            replica_id=self.replica_id,
            preparer=self.preparer,
        )
        self._restorer = Restorer(
            PartPlanner(
                log,
                catalog,
                self.projectors,
                replica_id=self.replica_id,
                owned_now=self._ownership.of,
            ),
            ProjectionServer(log, catalog, self.projectors, self._restore_cache, self.preparer),
            deadline_s=restore_deadline_s,
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Take this replica's partition leases (a first tick, then the heartbeat), then start a
        projector for every run in the catalog (each rebuilds its owned partitions from the log).

        One run's trouble never fails the start: its projector goes on in the background under
        its supervisor (reported ``degraded`` or ``stopped``) while the others serve. The start
        waits up to ``START_WAIT_S`` for the runs to catch up with their logs.
        """
        # Checkpoints an earlier process under this id left pending: nobody will finish them.
        await self.catalog.abort_pending_checkpoints(
            "aborted on start: left pending by a crash", requested_by=self.replica_id
        )
        await self._ownership.start()
        try:
            await self._start_projectors()
        except BaseException:
            await self.stop()
            raise

    async def _start_projectors(self) -> None:
        self._spawn(self.health_reporter.publish_forever())
        self._spawn(self._checkpointer.sweep())
        after: str | None = None
        launched: list[Projector] = []
        while True:
            page = await self.catalog.list_runs(after=after, limit=100)
            for summary in page:
                async with self._start_lock:  # a relaunch after the first tick may be first
                    run = summary.run.run
                    launched.append(self.projectors.get(run) or await self._launch(run))
            if len(page) < 100:
                break
            after = page[-1].run.run
        # Other replicas' restores: this replica plans its partitions' parts.
        self._spawn(self._restorer.poll())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_WAIT_S):
                await asyncio.gather(*(projector.settled.wait() for projector in launched))

    async def stop(self) -> None:
        """Stop the projectors, then release the leases (the other replicas take over at once)."""
        await self._ownership.stop()
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.preparer.stop()
        for projector in self.projectors.values():
            await projector.stop()
        self.projectors.clear()
        await self._ownership.release()

    async def create_run(self, run: str, partitions: int | None = None) -> int:
        """Create (or find, with the same settings) a run in the catalog and its log topic."""
        created = await self.catalog.create_run(run, partitions=partitions, log_url=self.log.url)
        projector = self.projectors.get(run)
        if projector is not None:
            projector.check_running()  # never re-create a lost run's topic
            return projector.partitions
        actual = await self.log.ensure_run(run, created.partitions)
        await self._ownership.tick()  # owned at once, not at the next heartbeat
        await self.projector(run)
        return actual

    async def fork_run(
        self, run: str, request: ForkRequest, partitions: int | None = None
    ) -> ForkResult:
        """Create ``run`` as a fork of another run's committed checkpoint (``_fork.py``), then
        follow it as any run."""
        async with self._run_locks[run]:
            result = await fork_run(
                self.log,
                self.catalog,
                run,
                request,
                committed_checkpoint=lambda source, ref: committed_checkpoint(
                    self.catalog, source, ref
                ),
                partitions=partitions,
                replica_id=self.replica_id,
            )
        await self.create_run(run, result.run.partitions)
        return result

    async def projector(self, run: str) -> Projector:
        """The run's projector (started on first use; ``UnknownRun`` for no such run). Waits up
        to ``SETTLE_WAIT_S`` for a starting projector's first catch-up."""
        projector = self.projectors.get(run)
        if projector is None:
            async with self._start_lock:
                projector = self.projectors.get(run)
                if projector is None:
                    projector = await self._launch(run)
        if not projector.settled.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_WAIT_S):
                    await projector.settled.wait()
        return self.projectors.get(run, projector)  # relaunched meanwhile: the new one

    async def follow(self, run: str) -> None:
        """Follow the run (``UnknownRun`` for no such run): its projector is started, and has
        caught up once or waited ``SETTLE_WAIT_S`` for it."""
        await self.projector(run)

    async def _launch(self, run: str) -> Projector:
        """Create the run's projector for the partitions this replica owns and start it under
        its supervisor (in the background)."""
        info = await self.catalog.get_run(run)
        owned = self._ownership.of(run)
        projector = Projector(self.log, run, info.partitions, owned=owned, generations=owned)
        self._checkpointer.attach(projector)
        self.projectors[run] = projector
        projector.launch(lambda: start_plan(self.log, self.catalog, run))
        self._recorders[run] = [
            self._spawn(record_episodes(self.catalog, projector)),
            self._spawn(record_quarantine(self.catalog, projector)),
        ]
        return projector

    def _owners_changed(self, runs: set[str]) -> None:
        for run in runs:
            if run in self.projectors or self._ownership.of(run):  # not a run deleted here
                self._spawn(self._relaunch(run))

    async def _relaunch(self, run: str) -> None:
        """Start the run's projector afresh for the partitions this replica owns now (none yet
        for a run it did not follow: launch one), unless it already folds exactly those. Not in
        the middle of a restore of this replica (which holds the run's lock)."""
        async with self._run_locks[run], self._start_lock:
            owned = self._ownership.of(run)
            old = self.projectors.get(run)
            if old is None and not owned:
                return
            if old is not None and old.owned == frozenset(owned) and old.generations == owned:
                return
            if old is not None:
                await old.stop()
                old.settled.set()  # whoever waits for its catch-up goes on (to the new one)
                recorders = self._recorders.pop(run, [])
                for task in recorders:  # each flushes what its projector queued, then ends
                    task.cancel()
                await asyncio.gather(*recorders, return_exceptions=True)
            try:
                await self._launch(run)
            except UnknownRun:  # deleted meanwhile
                self.projectors.pop(run, None)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background %s failed", task.get_coro(), exc_info=task.exception())

    # -- checkpoints and restores ----------------------------------------------------------

    async def pending_exports(
        self, run: str, participant: str, wait_s: float
    ) -> dict[str, Any] | None:
        """Export requests of the run's pending checkpoint for one participant (long poll)."""
        await self.projector(run)  # unknown_run for a run that does not exist
        return await self._checkpointer.pending_exports(run, participant, wait_s)

    async def checkpoint(
        self, run: str, controller_epoch: int, **options: Unpack[CheckpointOptions]
    ) -> CheckpointResult | int:
        """Take a checkpoint (``Checkpointer.checkpoint``): the committed result, or the id of
        the checkpoint left ``pending`` (``wait=False`` while wait steps are open)."""
        return await self._checkpointer.checkpoint(run, controller_epoch, **options)

    async def restore(
        self,
        run: str,
        controller_epoch: int,
        checkpoint_id: int | str = "latest",
        *,
        exclude: Iterable[str] = (),
        policy_version: int | None = None,
        max_policy_lag: int | None = None,
        exclude_results: bool = False,
        settle_after: bool = False,
    ) -> RestoreResult:
        """Plan and commit a restore from a committed checkpoint, all or nothing
        (``settle_after``: ``Restorer.restore``'s)."""
        projector = await self.projector(run)
        projector.check_running()
        policy = RestorePolicy(policy_version, max_policy_lag)
        with collector_paused():
            return await self._restorer.restore(
                projector,
                controller_epoch,
                checkpoint_id,
                exclude,
                policy,
                exclude_results,
                lock=self._run_locks[run],
                settle_after=settle_after,
            )

    async def sync_results(self, run: str) -> None:
        """Bring the catalog's results up to the log (``UnknownRun``): every record appended
        before the call (by anyone: ``latest_offsets``) is folded and its finish recorded, so a result whose reply left an
        environment is readable (and can be acknowledged) once the trainer asks."""
        projector = await self.projector(run)
        projector.check_running()
        await projector.wait_until(
            dict(enumerate(await self.log.latest_offsets(run))), timeout_s=DEFAULT_WAIT_DEADLINE_S
        )
        await flush_episodes(self.catalog, projector, finishes_only=True)

    async def restore_projections(self, run: str, restore_id: int) -> dict[str, EpisodeProjection]:
        """Every continued episode's projection of a committed restore (recomputed after a
        service restart: deterministic from the log and the catalog)."""
        return await self._restorer.projections.restore_projections(run, restore_id)

    async def restore_projection_lines(self, run: str, restore_id: int) -> RestoreLines:
        """``restore_projections`` as the routes serve them: NDJSON lines, streamed as they are
        built (cached, within the restore cache's byte budget)."""
        return await self._restorer.projections.projection_lines(run, restore_id)

    async def checkpoint_projection(
        self, run: str, checkpoint_id: int, episode: str
    ) -> EpisodeProjection:
        """One episode's projection at a committed checkpoint's cut (no restore needed)."""
        return await self._restorer.projections.checkpoint_projection(run, checkpoint_id, episode)

    # -- run deletion ----------------------------------------------------------------------

    async def delete_run(self, run: str) -> bool:
        """Delete a run: its catalog rows, its projector, its log topic; False when it had none
        of them. Catalog rows go first, so no projector can start for the run again, and the log
        last: a failure in between leaves a run that is gone from the catalog but not from the
        log, and deleting it again finishes the job."""
        async with self._run_locks[run]:  # not in the middle of a restore
            try:
                await self.catalog.delete_run(run)
                had_rows = True
            except UnknownRun:
                had_rows = False
            async with self._start_lock:
                projector = self.projectors.pop(run, None)
            if projector is not None:
                await projector.stop()
                projector.drop_unrecorded()  # the run's rows are gone
            recorders = self._recorders.pop(run, [])
            for task in recorders:
                task.cancel()
            await asyncio.gather(*recorders, return_exceptions=True)
            self._restore_cache.forget_run(run)
            self.preparer.forget(run)
            await self._checkpointer.forget_run(run)
            had_log = await self.log.delete_run(run)
        self._run_locks.pop(run, None)
        return had_rows or had_log

    # -- read doors: what the projectors track (the API never reaches into them) ------------

    def health(self) -> dict[str, RunHealth]:
        """Every started run's projector health."""
        return {run: projector.health for run, projector in list(self.projectors.items())}

    def owned_partitions(self, run: str) -> dict[int, int]:
        """The run's partitions this replica owns, with their lease generations."""
        return dict(self._ownership.of(run))

    def owned_partition_counts(self) -> dict[str, int]:
        """Per run this replica owns partitions of, how many."""
        return {run: len(owned) for run, owned in self._ownership.owned.items()}

    async def partition_owners(self, run: str) -> list[PartitionOwner]:
        """Every partition of the run with the replica that owns it (from the catalog)."""
        return await self.catalog.partition_owners(run)

    async def runs_health(self, run: str | None = None) -> dict[str, RunHealthReport]:
        """Every run's (or one run's) health across replicas: which partitions and replicas
        hold it back (``_health.py``)."""
        return await self.health_reporter.runs(run)

    def run_health(self, run: str) -> RunHealth | None:
        """The run's projector health, or None for a run this service does not follow yet."""
        projector = self.projectors.get(run)
        return projector.health if projector is not None else None

    def check_appendable(self, run: str) -> None:
        """``RunLost`` when the run's projector stopped: its log lost records the catalog names,
        and an append would land at offsets its checkpoints already name."""
        projector = self.projectors.get(run)
        if projector is not None:
            projector.check_running()

    def live_episode_count(self, run: str) -> int | None:
        """How many episodes of the run are live (tracked, not finished), or None for a run
        this service does not follow yet."""
        projector = self.projectors.get(run)
        return projector.live_episodes() if projector is not None else None

    def tracked_episodes(self, run: str) -> list[TrackedEpisode]:
        """Every episode the run's projector tracks, in tracking order."""
        projector = self.projectors.get(run)
        if projector is None:
            return []
        return [
            TrackedEpisode(
                name,
                tracker.attempt,
                tracker.finished,
                tracker.partition,
                tracker.first_offset,
                tracker.first_ts,
            )
            for name, tracker in list(projector.trackers.items())
        ]

    def tracked_bytes(self, run: str) -> int:
        """The bytes the run's live episodes hold so far (what a checkpoint's manifest sizes)."""
        projector = self.projectors.get(run)
        if projector is None:
            return 0
        return sum(t.size_bytes for t in list(projector.trackers.values()) if not t.finished)

    def tracked_episode(self, run: str, episode: str) -> tuple[int, bool] | None:
        """``(attempt, finished)`` of an episode this service's projector tracks, else None."""
        projector = self.projectors.get(run)
        tracker = projector.trackers.get(episode) if projector is not None else None
        return (tracker.attempt, tracker.finished) if tracker is not None else None

    def current_attempt(self, run: str, episode: str) -> int | None:
        """The episode's attempt as the projector has seen it in the log, or None."""
        tracked = self.tracked_episode(run, episode)
        return tracked[0] if tracked is not None else None

    def is_retired(self, run: str, episode: str) -> bool:
        """Whether the projector ignores the episode's later events: a restore excluded it, or a
        checkpoint reported it finished."""
        projector = self.projectors.get(run)
        return projector is not None and episode in projector.retired

    def highest_seq(self, run: str, participant: tuple[str, int]) -> int | None:
        """The highest ``seq`` the projector saw in the log from a participant epoch, or None."""
        projector = self.projectors.get(run)
        if projector is None:
            return None
        high: int | None = None
        for tracker in list(projector.trackers.values()):
            seen = tracker.filters.last_seq(participant)
            if seen is not None and (high is None or seen > high):
                high = seen
        return high

    def events_applied(self) -> dict[str, int]:
        """Per started run, the records its projector applied since the service started."""
        return {run: p.events_applied for run, p in list(self.projectors.items())}

    def run_events_applied(self, run: str) -> int:
        projector = self.projectors.get(run)
        return projector.events_applied if projector is not None else 0

    def quarantined_counts(self) -> dict[str, int]:
        """Per started run, the records its projector quarantined since the service started."""
        return {run: p.quarantined_count for run, p in list(self.projectors.items())}

    def live_episode_counts(self) -> dict[str, int]:
        """Per started run, its live episodes."""
        return {run: p.live_episodes() for run, p in list(self.projectors.items())}

    async def episode_records(
        self, run: str, episode: str, *, start: int = 0, end: int | None = None, limit: int = 1000
    ) -> tuple[int, list[tuple[int, bytes]], int | None]:
        """``(partition, records, next_start)``: up to ``limit`` of the episode's raw records
        in ``start <= offset < end`` of its partition (``end`` None: the log's end);
        ``next_start`` is where to go on, or None."""
        projector = await self.projector(run)
        partition = partition_for(episode, projector.partitions)
        log_end = (await self.log.latest_offsets(run))[partition]  # other replicas' too
        end = log_end if end is None else min(end, log_end)
        found: list[tuple[int, bytes]] = []
        async for page in self.log.read_pages(run, partition, start, end):
            for offset, record in page:
                if record_episode(record) == episode:
                    found.append((offset, record))
                    if len(found) >= limit:
                        return partition, found, offset + 1
        return partition, found, None

    async def projector_lag(self, run: str) -> list[tuple[int, int, int]]:
        """``(partition, end_offset, applied)`` per partition this replica folds: how far the
        projector trails the log (the other partitions' owners report theirs), other writers'
        records included."""
        projector = await self.projector(run)
        ends = await self.log.latest_offsets(run)
        return [
            (partition, end, min(applied, end))
            for partition, (end, applied) in enumerate(zip(ends, projector.applied, strict=True))
            if partition in projector.owned
        ]
