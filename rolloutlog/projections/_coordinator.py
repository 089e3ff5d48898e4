"""The coordinator: drives checkpoints and restores over the log, the projector and the catalog.

Checkpoint (docs/design.md §6): controller epoch check and a ``pending`` row → markers into every
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
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

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
    BackendUnavailable,
    InvalidRequest,
    RolloutlogError,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRestore,
    UnknownRun,
)
from rolloutlog.log import Log, Record, attempt_started_record, partition_for, record_episode
from rolloutlog.projections._fold import project_raw
from rolloutlog.projections._model import EpisodeProjection
from rolloutlog.projections._plan import all_restores, start_plan
from rolloutlog.projections._projector import (
    CheckpointCapture,
    Projector,
    RestoreReset,
    RunHealth,
)
from rolloutlog.projections._tracker import EpisodeTracker
from rolloutlog.projections._verify import apply_policy, verify_projection

logger = logging.getLogger(__name__)

_STAGING_KEYS = attrgetter("staging_keys")

#: How long a checkpoint waits for open wait steps when the request names no deadline; also how
#: long a checkpoint or restore waits for the projector to reach the log's offsets.
DEFAULT_WAIT_DEADLINE_S = 30.0
#: How long the service's start waits for its runs' projectors to catch up with their logs.
START_WAIT_S = 30.0
#: How long a request waits for a starting projector's first catch-up.
SETTLE_WAIT_S = 10.0

#: Catalog writes the service owes (episode records, a failed checkpoint's abort) are retried
#: with exponential backoff capped here, jittered so that runs and replicas spread out.
_RETRY_MAX_S = 5.0
#: The episode records' last flush on the way out waits at most this for the catalog.
_LAST_FLUSH_S = 5.0


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
        #: Per run, the tasks that feed the catalog from its projector (ended with the run).
        self._recorders: dict[str, list[asyncio.Task[Any]]] = {}
        self._restore_cache: dict[tuple[str, int], dict[str, EpisodeProjection]] = {}
        self._cache_budget = projection_cache_bytes

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start a projector for every run in the catalog (each rebuilds itself from the log).

        One run's trouble never fails the start: its projector goes on in the background under
        its supervisor (reported ``degraded`` or ``stopped``) while the others serve. The start
        waits up to ``START_WAIT_S`` for the runs to catch up with their logs.
        """
        after: str | None = None
        launched: list[Projector] = []
        while True:
            page = await self.catalog.list_runs(after=after, limit=100)
            for summary in page:
                launched.append(await self._launch(summary.run.run))
            if len(page) < 100:
                break
            after = page[-1].run.run
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_WAIT_S):
                await asyncio.gather(*(projector.settled.wait() for projector in launched))

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
        projector = self.projectors.get(run)
        if projector is not None:
            projector.check_running()  # never re-create a lost run's topic
            return projector.partitions
        actual = await self.log.ensure_run(run, created.partitions)
        await self.projector(run)
        return actual

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
        return projector

    def health(self) -> dict[str, RunHealth]:
        """Every started run's projector health."""
        return {run: projector.health for run, projector in list(self.projectors.items())}

    def check_appendable(self, run: str) -> None:
        """``RunLost`` when the run's projector stopped: its log lost records the catalog names,
        and an append would land at offsets its checkpoints already name."""
        projector = self.projectors.get(run)
        if projector is not None:
            projector.check_running()

    async def _launch(self, run: str) -> Projector:
        """Create the run's projector and start it under its supervisor (in the background)."""
        info = await self.catalog.get_run(run)
        projector = Projector(self.log, run, info.partitions)
        self.projectors[run] = projector
        projector.launch(lambda: start_plan(self.log, self.catalog, run))
        self._recorders[run] = [
            self._spawn(self._record_episodes(projector)),
            self._spawn(self._record_quarantine(projector)),
        ]
        return projector

    async def _record_quarantine(self, projector: Projector, every_s: float = 1.0) -> None:
        """Record the projector's quarantined records in the catalog, in batches; a batch the
        catalog refuses (it is down) stays and is tried again (the projector never waits)."""
        try:
            while True:
                await asyncio.sleep(every_s)
                await self._flush_quarantine(projector)
        finally:
            with contextlib.suppress(Exception):
                await self._flush_quarantine(projector)

    async def _flush_quarantine(self, projector: Projector) -> None:
        while projector.new_quarantined:
            batch = projector.new_quarantined[:1000]
            try:
                await self.catalog.quarantine(projector.run, batch)
            except Exception as e:  # the catalog is down: keep the batch for the next tick
                logger.warning(
                    "could not record %d quarantined record(s) of run %s: %s",
                    len(batch),
                    projector.run,
                    e,
                )
                return
            del projector.new_quarantined[: len(batch)]

    async def _record_episodes(self, projector: Projector, every_s: float = 1.0) -> None:
        """Feed the catalog's episodes table (for analysts) from the projector, in batches.

        While the catalog is unavailable the batches stay queued and are retried with jittered
        backoff: an episode that finishes during an outage must not stay ``running`` for good.
        """
        failures = 0
        try:
            while True:
                await asyncio.sleep(_backoff_s(failures, every_s) if failures else every_s)
                try:
                    await self._flush_episodes(projector)
                except RolloutlogError as e:  # retriable: the batch is kept
                    failures += 1
                    if failures == 1:
                        logger.warning(
                            "could not record episodes of run %s; retrying until the catalog "
                            "takes them: %s",
                            projector.run,
                            e.message,
                        )
                    continue
                if failures:
                    logger.info(
                        "recorded the episodes of run %s after %d failed attempts",
                        projector.run,
                        failures,
                    )
                failures = 0
        finally:
            # Last flush on the way out, bounded: a hung catalog must not hold up the stop.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_LAST_FLUSH_S):
                    await self._flush_episodes(projector)

    async def _flush_episodes(self, projector: Projector) -> None:
        """Record the projector's new starts and finishes. A retriable catalog error keeps the
        batch queued and is raised; any other error drops that batch (the catalog refused it)."""
        while projector.new_starts or projector.new_finishes:
            starts, projector.new_starts = projector.new_starts[:5000], projector.new_starts[5000:]
            finishes = projector.new_finishes[:5000]
            projector.new_finishes = projector.new_finishes[5000:]
            done = False
            try:
                await self.catalog.record_episodes(projector.run, starts, finishes)
                done = True
            except Exception as e:
                if isinstance(e, RolloutlogError) and e.retriable:
                    raise
                done = True  # dropped: retrying what the catalog refuses would block the run
                logger.exception("the catalog refused episodes of run %s", projector.run)
            finally:
                if not done:
                    # Unavailable, or cancelled mid-write: back in front, in order (the
                    # projector may have queued more meanwhile). Sending a batch again whose
                    # commit did land is harmless: starts keep the first position, finishes
                    # are idempotent.
                    projector.new_starts[:0] = starts
                    projector.new_finishes[:0] = finishes

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

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
        projector.check_running()
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
            # A degraded projector may not get there: the checkpoint then fails (``unavailable``)
            # at its deadline instead of hanging, and the next one succeeds once it recovers.
            await projector.wait_until(
                {p: o + 1 for p, o in enumerate(markers)},
                timeout_s=deadline_s if deadline_s is not None else DEFAULT_WAIT_DEADLINE_S,
            )
            if not capture.reached.is_set():  # applied while the projector was catching up
                raise BackendUnavailable(
                    f"the projector of run {run!r} was catching up with the log when the "
                    f"markers of checkpoint {checkpoint_id} arrived; retry",
                    run=run,
                    health=projector.health.view(),
                )
            projector.check_running()
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
            projector.check_running()  # a run whose log was lost meanwhile commits nothing
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
        except RolloutlogError as e:
            if not e.retriable:  # the original failure matters more
                logger.exception("could not abort checkpoint %d of run %s", checkpoint_id, run)
                return
            # Left pending, it would refuse every later checkpoint of the run until a restart.
            logger.warning(
                "checkpoint %d of run %s could not be aborted yet (%s); retrying until the "
                "catalog takes it",
                checkpoint_id,
                run,
                e.message,
            )
            self._spawn(self._abort_until_landed(run, checkpoint_id, controller_epoch, reason))
        except Exception:  # as above; start-up aborts it otherwise
            logger.exception("could not abort checkpoint %d of run %s", checkpoint_id, run)

    async def _abort_until_landed(
        self, run: str, checkpoint_id: int, controller_epoch: int, reason: str
    ) -> None:
        """Retry a failed checkpoint's abort with jittered backoff until the catalog takes it."""
        failures = 0
        while True:
            failures += 1
            await asyncio.sleep(_backoff_s(failures, 0.5))
            try:
                await self.catalog.abort_checkpoint(run, checkpoint_id, controller_epoch, reason)
            except RolloutlogError as e:
                if e.retriable:
                    continue
                # Committed after all (its reply was lost), or a new controller's take-over
                # aborted it: either way it no longer blocks the run.
                logger.info("checkpoint %d of run %s: %s", checkpoint_id, run, e.message)
                return
            logger.info(
                "aborted checkpoint %d of run %s after %d attempts", checkpoint_id, run, failures
            )
            return

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
        projector.check_running()
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
        await projector.wait_until(
            dict(enumerate(await self.log.end_offsets(run))), timeout_s=DEFAULT_WAIT_DEADLINE_S
        )
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
        restores = {r.restore_id for r in await all_restores(self.catalog, run)}
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

        projector = self.projectors.get(run)
        quarantined = projector.quarantined if projector is not None else set()

        async def one(partition: int, cuts: dict[str, int]) -> dict[str, EpisodeProjection]:
            records: dict[str, list[tuple[int, bytes]]] = {episode: [] for episode in cuts}
            end = max(cuts.values())
            start = replay_from.get(partition, 0)
            async for page in self.log.read_pages(run, partition, start, end):
                for item in page:
                    if quarantined and (partition, item[0]) in quarantined:
                        continue  # the projector skipped it: so does the fold
                    try:
                        episode = record_episode(item[1])
                    except ValueError:  # not an envelope (the projector quarantines it)
                        continue
                    wanted = records.get(episode)  # type: ignore[arg-type]
                    if wanted is not None:
                        wanted.append(item)

            out: dict[str, EpisodeProjection] = {}
            with collector_paused():
                for episode in cuts:
                    if not records[episode]:
                        continue
                    try:
                        out[episode] = project_raw(
                            episode,
                            records[episode],
                            cuts[episode],
                            committed_restores,
                            as_attempt=None if attempts is None else attempts.get(episode),
                            attempt=at_cut[episode],
                        )
                    except Exception:  # a record the fold cannot apply: it has no projection
                        logger.exception("run %s: could not fold episode %s", run, episode)
            return out

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
        """One ``attempt.started`` per planned episode (``attempt_started_record``)."""
        now = time.time()
        records = [
            Record(
                partition_for(entry.episode, partitions),
                entry.episode.encode(),
                attempt_started_record(
                    entry.episode,
                    entry.attempt,
                    restore_id=restore_id,
                    checkpoint_id=checkpoint_id,
                    previous_attempt=entry.previous_attempt,
                    cut=cuts[entry.episode],
                    controller_epoch=controller_epoch,
                    ts=now,
                ),
            )
            for entry in plan
        ]
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
            r.restore_id for r in await all_restores(self.catalog, run) if r.restore_id < restore_id
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
        restores = {r.restore_id for r in await all_restores(self.catalog, run)}
        projections = await self.replay(run, [entry], replay_from, restores)
        projection = projections.get(episode)
        if projection is None:
            raise UnknownEpisode(
                f"episode {episode!r} has no events before its cut", episode=episode
            )
        return projection

    # -- run deletion (helper ``embedded``) -------------------------------------------------------

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
                # Nothing more for the catalog: the run's rows are gone.
                projector.new_starts.clear()
                projector.new_finishes.clear()
                projector.new_quarantined.clear()
            recorders = self._recorders.pop(run, [])
            for task in recorders:
                task.cancel()
            await asyncio.gather(*recorders, return_exceptions=True)
            for key in [key for key in self._restore_cache if key[0] == run]:
                del self._restore_cache[key]
            had_log = await self.log.delete_run(run)
        self._run_locks.pop(run, None)
        return had_rows or had_log

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


def _backoff_s(failures: int, first_s: float) -> float:
    """The delay before retry number ``failures`` (1, 2, …): doubling from ``first_s`` up to
    ``_RETRY_MAX_S``, times a random factor in [0.5, 1]."""
    delay: float = min(_RETRY_MAX_S, first_s * 2.0 ** min(failures - 1, 16))
    return delay * random.uniform(0.5, 1.0)


def _manifest(capture: CheckpointCapture) -> tuple[list[PartitionOffset], list[ManifestEntry]]:
    offsets = [
        PartitionOffset(partition, marker, min(capture.needed.get(partition, marker), marker))
        for partition, marker in sorted(capture.markers.items())
    ]
    return offsets, list(capture.entries.values())
