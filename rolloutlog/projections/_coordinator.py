"""The coordinator: drives checkpoints and restores over the log, the projector and the catalog.

Checkpoint (DESIGN.md §6): controller epoch check and a ``pending`` row → markers into every
partition → the projector reaches each marker (the manifest of each partition is taken right
there) → episodes with an open wait step extend their cut to that step's boundary, or restart at
the deadline → one manifest-last catalog transaction. Participants never pause.

Restore: the checkpoint's manifest → replay each partition's range up to the cuts (partitions in
parallel) → fold, verify and apply the policy rule to every ``continue`` episode →
``attempt.started`` records → one catalog transaction for the plan. A failure anywhere commits
nothing: the projector discards the restore and the old attempts stay current.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import orjson

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import (
    Catalog,
    Checkpoint,
    ManifestEntry,
    PartitionOffset,
    Restore,
    RestoreAction,
    RestoreEntry,
)
from rolloutlog.errors import (
    InvalidRequest,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRestore,
)
from rolloutlog.log import Log, Record, partition_for, record_episode
from rolloutlog.log._events import SERVICE_PARTICIPANT_ID
from rolloutlog.projections._fold import project_raw
from rolloutlog.projections._model import EpisodeProjection
from rolloutlog.projections._projector import (
    CheckpointCapture,
    Projector,
    RestoreReset,
)
from rolloutlog.projections._tracker import EpisodeTracker
from rolloutlog.projections._verify import apply_policy, verify_projection

logger = logging.getLogger(__name__)

_STAGING_KEYS = attrgetter("staging_keys")

#: How long a checkpoint waits for open wait steps when the request names no deadline.
DEFAULT_WAIT_DEADLINE_S = 30.0


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    checkpoint: Checkpoint
    staging_keys: tuple[str, ...]
    timings_ms: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore: Restore
    entries: tuple[RestoreEntry, ...]
    timings_ms: Mapping[str, float]


@dataclass
class _Timer:
    started: float = field(default_factory=time.perf_counter)
    last: float = field(default_factory=time.perf_counter)
    stages: dict[str, float] = field(default_factory=dict)

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = round((now - self.last) * 1000, 3)
        self.last = now

    def total(self) -> dict[str, float]:
        return {**self.stages, "total": round((time.perf_counter() - self.started) * 1000, 3)}


class Coordinator:
    """One per service: owns a projector per run and runs checkpoints and restores."""

    def __init__(self, log: Log, catalog: Catalog, *, projection_cache_bytes: int = 512 << 20):
        self.log = log
        self.catalog = catalog
        self.projectors: dict[str, Projector] = {}
        self._run_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._start_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._restore_cache: dict[tuple[str, int], dict[str, EpisodeProjection]] = {}
        self._cache_budget = projection_cache_bytes

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start a projector for every run in the catalog (each rebuilds itself from the log)."""
        after: str | None = None
        while True:
            page = await self.catalog.list_runs(after=after, limit=100)
            for summary in page:
                await self.projector(summary.run.run)
            if len(page) < 100:
                return
            after = page[-1].run.run

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for projector in self.projectors.values():
            await projector.stop()
        self.projectors.clear()

    async def create_run(self, run: str, partitions: int | None = None) -> int:
        """Create (or find, with the same settings) a run in the catalog and its log topic."""
        created = await self.catalog.create_run(run, partitions=partitions, log_url=self.log.url)
        actual = await self.log.ensure_run(run, created.partitions)
        await self.projector(run)
        return actual

    async def projector(self, run: str) -> Projector:
        projector = self.projectors.get(run)
        if projector is not None:
            return projector
        async with self._start_lock:
            if run in self.projectors:
                return self.projectors[run]
            projector = await self._start_projector(run)
            self.projectors[run] = projector
            return projector

    async def _start_projector(self, run: str) -> Projector:
        info = await self.catalog.get_run(run)
        partitions = await self.log.ensure_run(run, info.partitions)
        start = [0] * partitions
        markers: list[int] | None = None
        if info.latest_checkpoint_id is not None:
            latest = await self.catalog.get_checkpoint(run, info.latest_checkpoint_id)
            markers = [0] * partitions
            for offset in latest.offsets:
                markers[offset.partition] = offset.marker
                start[offset.partition] = (
                    offset.replay_from if offset.replay_from is not None else offset.marker
                )
        restores = await _all_restores(self.catalog, run)
        restored: dict[str, int] = {}  # episode -> the attempt its latest restore made current
        retired: set[str] = set()
        for restore in sorted(restores, key=lambda r: r.restore_id):
            for entry in await self.catalog.restore_episodes(run, restore.restore_id, limit=None):
                if entry.action == "excluded":
                    retired.add(entry.episode)
                else:  # their records need the restore's truncation
                    restored[entry.episode] = entry.attempt
        projector = Projector(self.log, run, partitions)
        await projector.start(
            start,
            committed_restores=[r.restore_id for r in restores],
            retired=retired,
            refold={e: a for e, a in restored.items() if e not in retired},
            reported_below=markers,
        )
        self._spawn(self._record_episodes(projector))
        return projector

    async def _record_episodes(self, projector: Projector, every_s: float = 1.0) -> None:
        """Feed the catalog's episodes table (for analysts) from the projector, in batches."""
        try:
            while True:
                await asyncio.sleep(every_s)
                await self._flush_episodes(projector)
        finally:
            with contextlib.suppress(Exception):
                await self._flush_episodes(projector)

    async def _flush_episodes(self, projector: Projector) -> None:
        while projector.new_starts or projector.new_finishes:
            starts, projector.new_starts = projector.new_starts[:5000], projector.new_starts[5000:]
            finishes = projector.new_finishes[:5000]
            projector.new_finishes = projector.new_finishes[5000:]
            try:
                await self.catalog.record_episodes(projector.run, starts, finishes)
            except Exception:
                logger.exception("could not record episodes of run %s", projector.run)
                return

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background %s failed", task.get_coro(), exc_info=task.exception())

    # -- checkpoints -----------------------------------------------------------------------

    async def checkpoint(
        self,
        run: str,
        controller_epoch: int,
        *,
        deadline_s: float | None = None,
        wait: bool = True,
        trigger: str = "request",
    ) -> CheckpointResult | int:
        """Take a checkpoint. Returns the committed result, or (``wait=False`` while wait steps
        are still open) the id of the checkpoint that stays ``pending`` and commits later."""
        projector = await self.projector(run)
        timer = _Timer()
        checkpoint_id = await self.catalog.begin_checkpoint(
            run, controller_epoch, trigger=trigger, deadline_s=deadline_s
        )
        timer.stage("begin")
        capture = projector.begin_capture(checkpoint_id)
        try:
            markers = await self.log.write_markers(run, checkpoint_id, controller_epoch)
            marked_at = time.time()
            timer.stage("markers")
            await projector.wait_until({p: o + 1 for p, o in enumerate(markers)})
            await capture.reached.wait()
            timer.stage("projector")
        except BaseException:
            await self._abort(run, checkpoint_id, controller_epoch, capture, "marking failed")
            raise
        if capture.waiting and not wait:
            self._spawn(
                self._finish_checkpoint(
                    run, controller_epoch, capture, timer, deadline_s, marked_at
                )
            )
            return checkpoint_id
        return await self._finish_checkpoint(
            run, controller_epoch, capture, timer, deadline_s, marked_at
        )

    async def _finish_checkpoint(
        self,
        run: str,
        controller_epoch: int,
        capture: CheckpointCapture,
        timer: _Timer,
        deadline_s: float | None,
        marked_at: float,
    ) -> CheckpointResult:
        projector = self.projectors[run]
        checkpoint_id = capture.checkpoint_id
        try:
            if capture.waiting:
                deadline = deadline_s if deadline_s is not None else DEFAULT_WAIT_DEADLINE_S
                try:
                    async with asyncio.timeout(deadline):
                        await capture.resolved.wait()
                except TimeoutError:
                    capture.expire_waits(f"its wait step did not reach a boundary in {deadline} s")
            timer.stage("waits")
            offsets, entries = _manifest(capture)
            # Each key once, in the manifest's order (sorting 48,000 keys cost a S1 checkpoint
            # tens of milliseconds).
            staging = tuple(dict.fromkeys(chain.from_iterable(map(_STAGING_KEYS, entries))))
            timer.stage("manifest")
            timings = timer.total()
            committed = await self.catalog.commit_checkpoint(
                run,
                checkpoint_id,
                controller_epoch,
                offsets,
                entries,
                timings_ms=timings,
                marked_at=marked_at,
            )
            timer.stage("commit")
        except BaseException:
            await self._abort(run, checkpoint_id, controller_epoch, capture, "commit failed")
            raise
        projector.end_capture(capture, committed=True)
        self._spawn(self._trim(run))
        return CheckpointResult(committed, staging, timer.total())

    async def _abort(
        self,
        run: str,
        checkpoint_id: int,
        controller_epoch: int,
        capture: CheckpointCapture,
        reason: str,
    ) -> None:
        self.projectors[run].end_capture(capture, committed=False)
        try:
            await self.catalog.abort_checkpoint(run, checkpoint_id, controller_epoch, reason)
        except Exception:  # the original failure matters more; start-up aborts it otherwise
            logger.exception("could not abort checkpoint %d of run %s", checkpoint_id, run)

    async def _trim(self, run: str) -> None:
        """Drop log records no retained checkpoint needs (where the backend can)."""
        retained = await self.catalog.list_checkpoints(run, status="committed", limit=100)
        if not retained:
            return
        floor: dict[int, int] = {}
        for checkpoint in retained:
            full = await self.catalog.get_checkpoint(run, checkpoint.checkpoint_id)
            for offset in full.offsets:
                needed = offset.replay_from if offset.replay_from is not None else offset.marker
                floor[offset.partition] = min(floor.get(offset.partition, needed), needed)
        for partition, before in floor.items():
            if before > 0 and not await self.log.trim(run, partition, before):
                return

    # -- restores --------------------------------------------------------------------------

    async def restore(
        self,
        run: str,
        controller_epoch: int,
        checkpoint_id: int | str = "latest",
        *,
        exclude: Iterable[str] = (),
        policy_version: int | None = None,
        max_policy_lag: int | None = None,
    ) -> RestoreResult:
        """Plan and commit a restore from a committed checkpoint, all or nothing."""
        projector = await self.projector(run)
        async with self._run_locks[run]:
            with collector_paused():
                try:
                    return await self._restore(
                        projector,
                        run,
                        controller_epoch,
                        checkpoint_id,
                        exclude,
                        policy_version,
                        max_policy_lag,
                    )
                finally:
                    projector.release_pins()  # also when the restore failed before committing

    async def _restore(
        self,
        projector: Projector,
        run: str,
        controller_epoch: int,
        checkpoint_id: int | str,
        exclude: Iterable[str],
        policy_version: int | None,
        max_policy_lag: int | None,
    ) -> RestoreResult:
        timer = _Timer()
        info = await self.catalog.get_run(run)
        if info.controller_epoch != controller_epoch:
            raise StaleController(
                f"controller epoch {controller_epoch} is stale; run {run!r} is at "
                f"{info.controller_epoch}",
                run=run,
                controller_epoch=controller_epoch,
                current=info.controller_epoch,
            )
        checkpoint = await self._committed_checkpoint(run, checkpoint_id)
        # Everything appended before this request is folded: the episodes begun after the
        # markers (below) are then all known.
        await projector.wait_until(dict(enumerate(await self.log.end_offsets(run))))
        manifest = await self.catalog.load_manifest(run, checkpoint.checkpoint_id)
        current = await self.catalog.current_attempts(run)
        excluded = set(exclude)
        known = {entry.episode for entry in manifest}
        # Episodes begun after the markers are not in the checkpoint; their events belong to the
        # timeline the restore abandons, so they restart (or are excluded) like the others.
        markers = {o.partition: o.marker for o in checkpoint.offsets}
        beyond = projector.begun_after(markers, known)
        unknown = sorted(excluded - known - beyond.keys())
        if unknown:
            raise UnknownEpisode(
                f"{len(unknown)} excluded episode(s) are not in checkpoint "
                f"{checkpoint.checkpoint_id}: {unknown[:5]}",
                episodes=unknown[:100],
            )
        timer.stage("manifest")
        to_continue = [e for e in manifest if e.action == "continue" and e.episode not in excluded]
        replay_from = {
            o.partition: o.replay_from if o.replay_from is not None else o.marker
            for o in checkpoint.offsets
        }
        restores = {r.restore_id for r in await _all_restores(self.catalog, run)}
        new_attempts = {e.episode: current.get(e.episode, e.attempt) + 1 for e in to_continue}
        # Episodes untouched since this service captured the checkpoint have their verdict in
        # the projector already; only the others are replayed. Their projections are built when
        # first fetched (``restore_projections``). The policy rule changes projections, so a
        # request with a policy replays everything, as before.
        pinned = (
            projector.pin_cut_states(checkpoint.checkpoint_id, to_continue)
            if policy_version is None
            else {}
        )
        replayed = [e for e in to_continue if e.episode not in pinned]
        projections = (
            await self.replay(run, replayed, replay_from, restores, new_attempts)
            if replayed
            else {}
        )
        timer.stage("replay")
        plan: list[RestoreEntry] = []
        resets: dict[str, RestoreReset] = {}
        cuts: dict[str, int] = {}

        def decide(
            episode: str,
            previous: int,
            action: RestoreAction,
            reason: str | None = None,
            cut: int = 0,
            projection: EpisodeProjection | None = None,
            pinned: EpisodeTracker | None = None,
        ) -> None:
            attempt = previous + 1
            plan.append(RestoreEntry(episode, previous, attempt, action, reason))
            resets[episode] = RestoreReset(action, attempt, projection, pinned)
            cuts[episode] = cut

        for entry in manifest:
            episode = entry.episode
            previous = current.get(episode, entry.attempt)
            if episode in excluded:
                decide(episode, previous, "excluded")
                continue
            if entry.action == "finished":
                continue
            reason = "the checkpoint's manifest says restart" if entry.action == "restart" else None
            tracker = pinned.get(episode) if entry.action == "continue" else None
            if tracker is not None:
                reason = tracker.pinned_state().verdict()
                if reason is None:
                    decide(episode, previous, "continue", cut=entry.cut_offset, pinned=tracker)
                else:
                    decide(episode, previous, "restart", reason)
                continue
            projection = projections.get(episode)
            if entry.action == "continue":
                if projection is None:
                    reason = "no events before the cut"
                else:
                    reason = verify_projection(projection)
                    if reason is None:
                        projection, reason = apply_policy(
                            projection, policy_version, max_policy_lag
                        )
            if reason is None and projection is not None:
                projections[episode] = projection
                decide(episode, previous, "continue", cut=entry.cut_offset, projection=projection)
            else:
                projections.pop(episode, None)
                decide(episode, previous, "restart", reason)
        after_markers = f"began after the markers of checkpoint {checkpoint.checkpoint_id}"
        for episode in sorted(beyond):
            previous = current.get(episode, beyond[episode])
            if episode in excluded:
                decide(episode, previous, "excluded")
            else:
                decide(episode, previous, "restart", after_markers)
        timer.stage("verify")
        # Reserved before any record names it: a restore that dies before its commit leaves
        # attempt records under an id no later restore can commit.
        restore_id = await self.catalog.reserve_restore_id(run, controller_epoch)
        projector.begin_restore(restore_id, resets)
        committed = False
        try:
            await self._write_attempts(
                run,
                info.partitions,
                restore_id,
                checkpoint.checkpoint_id,
                plan,
                cuts,
                controller_epoch,
            )
            timer.stage("attempts")
            restore = await self.catalog.commit_restore(
                run,
                controller_epoch,
                checkpoint.checkpoint_id,
                plan,
                timings_ms=timer.total(),
                restore_id=restore_id,
            )
            committed = True
            timer.stage("commit")
        finally:
            projector.end_restore(restore_id, committed)
        if not pinned:  # else the projections are built when first fetched
            self._cache(run, restore_id, projections)
        # What stays (cached projections, the trackers' new states): keep the collector from
        # walking it again and again.
        gc.freeze()
        return RestoreResult(restore, tuple(plan), timer.total())

    async def _committed_checkpoint(self, run: str, checkpoint_id: int | str) -> Checkpoint:
        if checkpoint_id == "latest":
            checkpoint = await self.catalog.latest_checkpoint(run)
        elif isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
            checkpoint = await self.catalog.get_checkpoint(run, checkpoint_id)
        else:
            raise InvalidRequest(
                'checkpoint_id must be an integer or "latest"', field="checkpoint_id"
            )
        if checkpoint.status != "committed":
            raise UnknownCheckpoint(
                f"checkpoint {checkpoint.checkpoint_id} of run {run!r} is {checkpoint.status}: "
                "only a committed checkpoint can be restored",
                run=run,
                checkpoint_id=checkpoint.checkpoint_id,
                status=checkpoint.status,
            )
        return checkpoint

    async def replay(
        self,
        run: str,
        entries: Sequence[ManifestEntry],
        replay_from: Mapping[int, int],
        committed_restores: set[int],
        attempts: Mapping[str, int] | None = None,
    ) -> dict[str, EpisodeProjection]:
        """Fold every named episode at its cut; partitions are read in parallel. ``attempts``
        labels each projection with the attempt that continues it."""
        by_partition: dict[int, dict[str, int]] = defaultdict(dict)
        at_cut: dict[str, int] = {}
        for entry in entries:
            by_partition[entry.cut_partition][entry.episode] = entry.cut_offset
            at_cut[entry.episode] = entry.attempt

        async def one(partition: int, cuts: dict[str, int]) -> dict[str, EpisodeProjection]:
            records: dict[str, list[tuple[int, bytes]]] = {episode: [] for episode in cuts}
            end = max(cuts.values())
            start = replay_from.get(partition, 0)
            async for page in self.log.read_pages(run, partition, start, end):
                for item in page:
                    wanted = records.get(record_episode(item[1]))  # type: ignore[arg-type]
                    if wanted is not None:
                        wanted.append(item)

            with collector_paused():
                return {
                    episode: project_raw(
                        episode,
                        records[episode],
                        cuts[episode],
                        committed_restores,
                        as_attempt=None if attempts is None else attempts.get(episode),
                        attempt=at_cut[episode],
                    )
                    for episode in cuts
                    if records[episode]
                }

        results = await asyncio.gather(*(one(p, cuts) for p, cuts in by_partition.items()))
        merged: dict[str, EpisodeProjection] = {}
        for result in results:
            merged.update(result)
        return merged

    async def _write_attempts(
        self,
        run: str,
        partitions: int,
        restore_id: int,
        checkpoint_id: int,
        plan: Sequence[RestoreEntry],
        cuts: Mapping[str, int],
        controller_epoch: int,
    ) -> None:
        """One ``attempt.started`` per planned episode, encoded directly (the service's own
        records, built from validated values: no per-event model validation)."""
        now = time.time()
        writer = {"id": SERVICE_PARTICIPANT_ID, "kind": "service", "epoch": controller_epoch}
        records = []
        for index, entry in enumerate(plan):
            meta = {
                "v": 1,
                "episode": entry.episode,
                "attempt": entry.attempt,
                "step": None,
                "participant": writer,
                "seq": restore_id * 10_000_000 + index,
                "ts": now,
                "type": "attempt.started",
                "data": {
                    "restore_id": restore_id,
                    "checkpoint_id": checkpoint_id,
                    "previous_attempt": entry.previous_attempt,
                    "cut": cuts[entry.episode],
                },
            }
            records.append(
                Record(
                    partition_for(entry.episode, partitions),
                    entry.episode.encode(),
                    orjson.dumps(meta),
                )
            )
        for start in range(0, len(records), 4096):
            await self.log.append_records(run, records[start : start + 4096])

    def _cache(self, run: str, restore_id: int, projections: dict[str, EpisodeProjection]) -> None:
        self._restore_cache[(run, restore_id)] = projections
        total = 0
        for key in sorted(self._restore_cache, key=lambda k: -k[1]):
            size = sum(p.payload_bytes for p in self._restore_cache[key].values())
            total += size
            if total > self._cache_budget and key != (run, restore_id):
                del self._restore_cache[key]

    # -- serving projections ---------------------------------------------------------------

    async def restore_projections(self, run: str, restore_id: int) -> dict[str, EpisodeProjection]:
        """Every continued episode's projection of a committed restore (recomputed after a
        service restart: deterministic from the log and the catalog)."""
        cached = self._restore_cache.get((run, restore_id))
        if cached is not None:
            return cached
        restore = await self.catalog.get_restore(run, restore_id)
        entries = await self.catalog.restore_episodes(
            run, restore_id, action="continue", limit=None
        )
        checkpoint = await self.catalog.get_checkpoint(run, restore.checkpoint_id)
        if checkpoint.status != "committed":
            raise UnknownRestore(
                f"restore {restore_id} of run {run!r} came from checkpoint "
                f"{restore.checkpoint_id}, which is {checkpoint.status}: its projections are gone",
                run=run,
                restore_id=restore_id,
            )
        manifest = {
            e.episode: e for e in await self.catalog.load_manifest(run, restore.checkpoint_id)
        }
        wanted = [manifest[e.episode] for e in entries if e.episode in manifest]
        replay_from = {
            o.partition: o.replay_from if o.replay_from is not None else o.marker
            for o in checkpoint.offsets
        }
        restores = {
            r.restore_id
            for r in await _all_restores(self.catalog, run)
            if r.restore_id < restore_id
        }
        attempts = {e.episode: e.attempt for e in entries}
        result = await self.replay(run, wanted, replay_from, restores, attempts)
        self._cache(run, restore_id, result)
        return result

    async def checkpoint_projection(
        self, run: str, checkpoint_id: int, episode: str
    ) -> EpisodeProjection:
        """One episode's projection at a committed checkpoint's cut (no restore needed)."""
        checkpoint = await self._committed_checkpoint(run, checkpoint_id)
        manifest = {
            e.episode: e for e in await self.catalog.load_manifest(run, checkpoint.checkpoint_id)
        }
        entry = manifest.get(episode)
        if entry is None:
            raise UnknownEpisode(
                f"episode {episode!r} is not in checkpoint {checkpoint.checkpoint_id}",
                run=run,
                episode=episode,
            )
        replay_from = {
            o.partition: o.replay_from if o.replay_from is not None else o.marker
            for o in checkpoint.offsets
        }
        restores = {r.restore_id for r in await _all_restores(self.catalog, run)}
        projections = await self.replay(run, [entry], replay_from, restores)
        projection = projections.get(episode)
        if projection is None:
            raise UnknownEpisode(
                f"episode {episode!r} has no events before its cut", episode=episode
            )
        return projection

    # -- analysts' reads (issue 14): narrow, read-only doors for the episode history ---------

    async def episode_records(
        self, run: str, episode: str, *, start: int = 0, end: int | None = None, limit: int = 1000
    ) -> tuple[int, list[tuple[int, bytes]], int | None]:
        """``(partition, records, next_start)``: up to ``limit`` of the episode's raw records
        in ``start <= offset < end`` of its partition (``end`` None: the log's end);
        ``next_start`` is where to go on, or None."""
        projector = await self.projector(run)
        partition = partition_for(episode, projector.partitions)
        log_end = (await self.log.end_offsets(run))[partition]
        end = log_end if end is None else min(end, log_end)
        found: list[tuple[int, bytes]] = []
        async for page in self.log.read_pages(run, partition, start, end):
            for offset, record in page:
                if record_episode(record) == episode:
                    found.append((offset, record))
                    if len(found) >= limit:
                        return partition, found, offset + 1
        return partition, found, None

    def tracked_episode(self, run: str, episode: str) -> tuple[int, bool] | None:
        """``(attempt, finished)`` of an episode this service's projector tracks, else None."""
        projector = self.projectors.get(run)
        tracker = projector.trackers.get(episode) if projector is not None else None
        return (tracker.attempt, tracker.finished) if tracker is not None else None

    async def projector_lag(self, run: str) -> list[tuple[int, int]]:
        """``(end_offset, applied)`` per partition: how far the projector trails the log."""
        projector = await self.projector(run)
        ends = await self.log.end_offsets(run)
        return [
            (end, min(applied, end)) for end, applied in zip(ends, projector.applied, strict=True)
        ]


def _manifest(capture: CheckpointCapture) -> tuple[list[PartitionOffset], list[ManifestEntry]]:
    offsets = [
        PartitionOffset(partition, marker, min(capture.needed.get(partition, marker), marker))
        for partition, marker in sorted(capture.markers.items())
    ]
    return offsets, list(capture.entries.values())


async def _all_restores(catalog: Catalog, run: str) -> list[Restore]:
    out: list[Restore] = []
    before: int | None = None
    while True:
        page = await catalog.list_restores(run, before=before, limit=500)
        out.extend(page)
        if len(page) < 500:
            return out
        before = page[-1].restore_id
