"""The projector: follows the partitions of a run that this service replica owns (all of them
for a lone replica) and keeps what a manifest needs per episode.

It reads records as metadata only (the payload stays in the record, counted by size), applies the
fold's rules through ``EpisodeTracker``, and answers two questions of the coordinator:

- at a ``checkpoint.marker``: the manifest entries of the partition's episodes at that exact
  position in the partition's order (participants never pause; later events are simply after it);
- at an ``attempt.started``: whether its restore committed (the coordinator says so; the record
  is written before the catalog commit, so the partition waits for the verdict).

This module is the follow loop (start, catch-up, follow, quarantine, applying records); the
manifest capture (``_capture.py``) and what a restore does to the trackers
(``_restore_resets.py``) are the class's other two parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import random
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Container,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, cast

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import (
    QUARANTINE_FIRST_BYTES,
    EpisodeFinish,
    EpisodeStart,
    QuarantinedRecord,
)
from rolloutlog.core import EventFilters
from rolloutlog.errors import BackendUnavailable, RolloutlogError, RunLost, UnknownRun
from rolloutlog.log import (
    Log,
    partition_for,
    peek_record,
    record_payload_start,
    record_restore_id,
)
from rolloutlog.projections._capture import CheckpointCapture, ManifestBase, ManifestCapture
from rolloutlog.projections._feeders import Unrecorded
from rolloutlog.projections._fold import select_records
from rolloutlog.projections._quarantine import metadata_problem
from rolloutlog.projections._read_ahead import PagesAhead
from rolloutlog.projections._restore_resets import RestoreReset, RestoreResets
from rolloutlog.projections._run_health import STARTING, HealthStatus, RunHealth
from rolloutlog.projections._start_plan import StartPlan
from rolloutlog.projections._tracker import EpisodeTracker

logger = logging.getLogger(__name__)

#: The longest the projector applies records without letting the event loop run: a page holds up
#: to 8 MiB of records, and a page of tiny events took seconds, /healthz included.
_YIELD_EVERY_S = 0.02

__all__ = [
    "CheckpointCapture",
    "ManifestBase",
    "Projector",
    "STARTING",
    "RestoreReset",
    "RunHealth",
    "StartPlan",
]


#: Backoff of a projector that failed: transient errors from 0.1 s up to 5 s, others (a
#: non-retriable error that persists) from 1 s up to 30 s; each delay jittered by half.
_BACKOFF_TRANSIENT = (0.1, 5.0)
_BACKOFF_PERSISTENT = (1.0, 30.0)


def _transient(error: BaseException) -> bool:
    if isinstance(error, RolloutlogError):
        return error.retriable
    return isinstance(error, OSError | TimeoutError | ConnectionError)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if isinstance(error, RolloutlogError) else f"{type(error).__name__}: {text}"


class Projector(ManifestCapture, RestoreResets, Unrecorded):
    """Follows one run's partitions; one instance per run per service.

    ``start`` runs it under a supervisor: a failure (the log unreachable, a read error) makes it
    ``degraded`` and it starts again from its last applied offsets after a jittered backoff; a
    lost log (``RunLost``, ``UnknownRun``) stops it. Records it cannot fold are quarantined.
    """

    def __init__(
        self,
        log: Log,
        run: str,
        partitions: int,
        *,
        owned: Iterable[int] | None = None,
        generations: Mapping[int, int] | None = None,
    ) -> None:
        self.log = log
        self.run = run
        self.partitions = partitions
        self.trackers: dict[str, EpisodeTracker] = {}
        self.by_partition: list[dict[str, EpisodeTracker]] = [{} for _ in range(partitions)]
        self.applied: list[int] = [0] * partitions
        #: The partitions this projector folds, and the lease generation it holds each at
        #: (a replica folds only the partitions it owns; a lone replica owns all).
        #: Fixed for the projector's life: an owner change starts a new projector.
        self._owns_all = owned is None
        self.owned: frozenset[int] = frozenset(range(partitions) if owned is None else owned)
        self.generations: dict[int, int] = dict(generations or {})
        #: Episodes that need no tracking any more (reported finished, or excluded).
        self.retired: set[str] = set()
        self.committed_restores: set[int] = set()
        #: Per partition, the episodes whose trackers changed (or went) since the last marker
        #: captured there: all a capture that amends a base looks at.
        self._dirty: list[set[str]] = [set() for _ in range(partitions)]
        self._init_captures()
        self._init_restores()
        self._progress = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.events_applied = 0
        self._init_unrecorded()
        #: Every quarantined position.
        self.quarantined: set[tuple[int, int]] = set()
        self.quarantined_count = 0
        self.health = RunHealth("degraded", STARTING, time.time())
        #: Set once the first catch-up ended (caught up, or failed: the supervisor goes on).
        self.settled = asyncio.Event()
        self.caught_up = False
        self._failures = 0
        # While catching up the first time: records of the episodes to refold, buffered.
        self._refolding: dict[str, int] = {}
        self._buffered: dict[str, list[tuple[int, dict[str, Any], bytes]]] = {}
        self._reported_below: Sequence[int] | None = None
        #: While catching up: the partitions held at the marker of a checkpoint that was not
        #: over when the start was planned (``StartPlan.open_checkpoints_from``).
        self._open_from: int | None = None
        self._held: set[int] = set()
        #: Set by ``stop``: this projector folds nothing more (a newer one may take over).
        self.closed = asyncio.Event()

    @property
    def owns_every_partition(self) -> bool:
        """Whether this projector folds every partition of the run (a lone replica's does):
        its part of a restore is then the whole plan."""
        return self.owned >= frozenset(range(self.partitions))

    # -- lifecycle -------------------------------------------------------------------------

    def launch(self, prepare: Callable[[], Awaitable[StartPlan]]) -> None:
        """Follow the log in the background under the supervisor; ``prepare`` says where to
        start (it runs again until it succeeds). ``settled`` is set once caught up with the
        log's end or once the first try failed (``degraded``: it keeps trying)."""
        self._task = asyncio.create_task(self._supervise(prepare))

    async def stop(self) -> None:
        self.closed.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _supervise(self, prepare: Callable[[], Awaitable[StartPlan]]) -> None:
        planned = False
        while True:
            try:
                if not planned:
                    self._begin(await prepare())
                    planned = True
                await self._read_to_end()
                if not self.caught_up:
                    self._finish_catch_up()
                if self.health.status != "ok" and self._failures:
                    # The failed reads' tracebacks may hold the driver's cursors in reference
                    # cycles (an embedded log's open cursor keeps a read snapshot, which blocks
                    # the WAL's checkpoints): collect them now rather than whenever.
                    gc.collect()
                self._set_health("ok", None)
                self.settled.set()
                await self._follow()
            except asyncio.CancelledError:
                raise
            except (RunLost, UnknownRun) as e:
                error = e if isinstance(e, RunLost) else RunLost(str(e), run=self.run)
                logger.error("projector of run %s stopped: %s", self.run, error.message)
                await self._halt(error.message)
                return
            except Exception as e:  # any other failure: degraded, and try again
                self._failures += 1
                transient = _transient(e)
                if self._failures == 1:
                    logger.exception("projector of run %s failed; retrying", self.run)
                else:
                    logger.warning("projector of run %s failed again: %s", self.run, e)
                self._set_health("degraded", _describe(e))
                self.settled.set()
            # Only a failure gets here.
            async with self._progress:
                self._progress.notify_all()
            base, cap = _BACKOFF_TRANSIENT if transient else _BACKOFF_PERSISTENT
            delay = min(cap, base * 2 ** min(self._failures - 1, 16))
            await asyncio.sleep(delay / 2 + random.random() * delay / 2)

    def _set_health(self, status: HealthStatus, error: str | None) -> None:
        current = self.health
        if current.status != status or current.error != error:
            since = current.since if current.status == status else time.time()
            self.health = RunHealth(status, error, since)
            if status == "ok" and current.status != "ok":
                logger.info("projector of run %s is following the log again", self.run)

    async def _halt(self, error: str) -> None:
        """The run's log lost records: stop for good, release everyone waiting."""
        self._set_health("stopped", error)
        self.settled.set()
        if self._capture is not None:
            self._capture.reached.set()
            self._capture.resolved.set()
        async with self._progress:
            self._progress.notify_all()

    def _begin(self, plan: StartPlan) -> None:
        if len(plan.start_offsets) != self.partitions:  # the log's count wins over the catalog's
            self.partitions = len(plan.start_offsets)
            self.by_partition = [{} for _ in range(self.partitions)]
            self._dirty = [set() for _ in range(self.partitions)]
            everything = range(self.partitions)
            self.owned = frozenset(everything if self._owns_all else self.owned & set(everything))
        self.committed_restores.update(plan.committed_restores)
        self.retired.update(plan.retired)
        self.applied = list(plan.start_offsets)
        self._refolding = dict(plan.refold)
        self._reported_below = plan.reported_below
        self.quarantined.update(plan.quarantined)
        self._open_from = plan.open_checkpoints_from
        for restore_id in plan.planning_restores:
            self.begin_restore(restore_id, None)

    async def _read_to_end(self) -> None:
        """Read (for real: this is also how a restarted projector knows it reads again) every
        owned partition up to the log's current end, other writers' records included (other
        replicas write markers and appends into every partition). The next partition's read is
        opened while the current one is folded where that hides a wait (``PagesAhead``)."""
        ends = await self.log.latest_offsets(self.run)
        applied = self.applied
        held = self._held
        todo = [p for p in sorted(self.owned) if applied[p] < ends[p] and p not in held]

        def read(partition: int) -> PagesAhead:
            pages = self.log.read_pages(self.run, partition, applied[partition], ends[partition])
            return PagesAhead(pages, self.log.read_ahead)

        ahead = read(todo[0]) if todo else None
        try:
            for following, partition in enumerate(todo, 1):
                pages, ahead = ahead, read(todo[following]) if following < len(todo) else None
                assert pages is not None
                try:
                    await self._catch_up(partition, pages)
                finally:
                    await pages.aclose()
                if partition not in held:
                    applied[partition] = max(applied[partition], ends[partition])
        finally:
            if ahead is not None:
                await ahead.aclose()
        async with self._progress:
            self._progress.notify_all()

    async def _catch_up(
        self, partition: int, pages: AsyncIterator[list[tuple[int, bytes]]]
    ) -> None:
        """Fold one partition's pages, up to a held marker if it meets one."""
        applied = self.applied
        held = self._held
        async for page in pages:
            # A page's records mostly make trackers that live on: collections while folding it
            # walked the growing heap again and again (a tenth of a catch-up's time).
            with collector_paused():
                for offset, record in page:
                    if offset < applied[partition]:
                        continue
                    verdict = self._take(partition, offset, record)
                    if verdict is not None:
                        await verdict
                    if partition in held:  # an open checkpoint's marker: met again later
                        self.events_applied -= 1
                        return
                    applied[partition] = offset + 1

    def _finish_catch_up(self) -> None:
        for episode, records in self._buffered.items():
            kept, attempt = select_records(
                records, math.inf, self.committed_restores, self._refolding[episode]
            )
            tracker = self._tracker(episode, partition_for(episode, self.partitions))
            tracker.filters = EventFilters.after(records, attempt)
            for offset, meta, kept_record in kept:
                record = cast(bytes, kept_record)  # buffered records are whole
                finished = tracker.finished
                try:
                    tracker.apply(offset, meta, record, record_payload_start(record))
                except Exception as e:  # the fold cannot apply it: skip it, as while following
                    self._quarantine(tracker.partition, offset, record, _fold_failure(e))
                if tracker.finished and not finished:  # its result may not be recorded yet
                    self.new_finishes.append(
                        _finish(tracker, meta, record, record_payload_start(record))
                    )
            tracker.attempt = attempt
            self._dirty[tracker.partition].add(episode)
        self._buffered.clear()
        self._refolding.clear()
        self._held.clear()  # the follower goes on from the held markers, caught up
        reported_below = self._reported_below
        if reported_below is not None:
            for episode, tracker in list(self.trackers.items()):
                if (
                    tracker.finished
                    and (tracker.finished_offset or 0) < reported_below[tracker.partition]
                ):
                    self._forget(episode)
                    self.retired.add(episode)
        self.caught_up = True
        # What catching up built lives on: keep the cyclic collector from walking it again.
        gc.freeze()

    async def _follow(self) -> None:
        """One follower for the owned partitions of the run, from the last applied offsets."""
        applied = self.applied
        take = self._take
        own_restores = self._applied_restores
        yield_at = time.perf_counter() + _YIELD_EVERY_S
        pages = self.log.follow_run(self.run, list(applied), partitions=self.owned)
        async for partition, page in pages:
            for offset, record in page:
                if offset < applied[partition]:
                    continue
                if time.perf_counter() > yield_at:
                    await asyncio.sleep(0)
                    yield_at = time.perf_counter() + _YIELD_EVERY_S
                if own_restores and record_restore_id(record) in own_restores:
                    # This projector applied the restore's resets when it committed: its
                    # 16,000 records change nothing more, so skip them undecoded.
                    self.events_applied += 1
                    applied[partition] = offset + 1
                    continue
                verdict = take(partition, offset, record)
                if verdict is not None:  # an in-flight restore's record: wait for it
                    await verdict
                applied[partition] = offset + 1
            self._failures = 0
            async with self._progress:
                self._progress.notify_all()

    async def wait_until(self, offsets: Mapping[int, int], timeout_s: float | None = None) -> None:
        """Wait until every owned partition has applied everything below the given offsets
        (the other partitions' owners fold theirs).

        ``BackendUnavailable`` when that takes longer than ``timeout_s`` (a degraded projector
        may get there later), ``RunLost`` when the projector stopped.
        """

        owned = self.owned

        def reached() -> bool:
            return all(self.applied[p] >= o for p, o in offsets.items() if p in owned)

        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(lambda: reached() or self.health.status == "stopped")
        except TimeoutError as e:
            raise self.not_reached("the log's offsets", timeout_s) from e
        self.check_running()

    def not_reached(self, what: str, timeout_s: float | None) -> BackendUnavailable:
        """The error of a wait for this projector to reach ``what`` that took longer than
        ``timeout_s`` (a degraded projector may get there later: its health says why)."""
        health = self.health
        why = f" ({health.status}: {health.error})" if health.status != "ok" else ""
        return BackendUnavailable(
            f"the projector of run {self.run!r} did not reach {what} within {timeout_s} s{why}; "
            "retry",
            run=self.run,
            health=health.view(),
        )

    def check_running(self) -> None:
        """``RunLost`` if the projector stopped (the run's log lost records)."""
        if self.health.status == "stopped":
            raise RunLost(self.health.error or f"run {self.run!r} is stopped", run=self.run)

    # -- quarantine ------------------------------------------------------------------------

    def _take(self, partition: int, offset: int, record: bytes) -> Awaitable[None] | None:
        """Check one record and apply it, or quarantine it (never raise: one bad record must
        not stop the run)."""
        try:
            meta, start = peek_record(record)
        except ValueError as e:  # orjson's JSONDecodeError
            self._quarantine(partition, offset, record, f"not a JSON envelope: {e}")
            return None
        problem = metadata_problem(meta)
        tracker = None
        if problem is None:
            episode = meta.get("episode")
            if episode is not None:
                tracker = self.trackers.get(episode)
                home = (
                    tracker.partition
                    if tracker is not None
                    else partition_for(episode, self.partitions)
                )
                if home != partition:
                    problem = f"episode {episode!r} belongs in partition {home}, not {partition}"
        if problem is not None:
            self._quarantine(partition, offset, record, problem)
            return None
        if self._refolding and meta.get("episode") in self._refolding:
            self._buffered.setdefault(meta["episode"], []).append((offset, meta, record))
            return None
        try:
            return self._apply(partition, offset, meta, record, start, tracker)
        except Exception as e:  # the fold cannot apply it: skip it, keep the run going
            self._quarantine(partition, offset, record, _fold_failure(e))
            return None

    def _quarantine(self, partition: int, offset: int, record: bytes, reason: str) -> None:
        if (partition, offset) in self.quarantined:
            return  # found again by a restarted projector: recorded already
        self.quarantined.add((partition, offset))
        self.quarantined_count += 1
        logger.warning(
            "run %s: quarantined the record at partition %d offset %d: %s",
            self.run,
            partition,
            offset,
            reason,
        )
        self.new_quarantined.append(
            QuarantinedRecord(
                partition, offset, reason, len(record), bytes(record[:QUARANTINE_FIRST_BYTES])
            )
        )

    # -- applying records ------------------------------------------------------------------

    def _tracker(self, episode: str, partition: int) -> EpisodeTracker:
        tracker = self.trackers.get(episode)
        if tracker is None:
            tracker = EpisodeTracker(episode, partition)
            self.trackers[episode] = tracker
            self.by_partition[partition][episode] = tracker
        return tracker

    def _apply(
        self,
        partition: int,
        offset: int,
        meta: dict[str, Any],
        record: bytes,
        start: int,
        tracker: EpisodeTracker | None,
    ) -> Awaitable[None] | None:
        """Apply one record at once (``record[start:]``: its payload; ``tracker``: its episode's,
        if ``_take`` found one); only the ``attempt.started`` of a restore whose verdict is still
        out returns something to await (synchronous otherwise: a restore's 16,000 records follow
        each other without a coroutine each)."""
        self.events_applied += 1
        kind = meta["type"]
        if kind == "checkpoint.marker":
            return self._on_marker(partition, offset, meta["data"]["checkpoint_id"])
        episode = meta["episode"]
        if episode in self.retired:
            return None
        if kind == "attempt.started":
            restore_id = meta["data"]["restore_id"]
            if restore_id in self.committed_restores:
                self._on_attempt_started(partition, meta)
                return None
            if restore_id in self._inflight_restores:
                return self._after_verdict(partition, meta, self._inflight_restores[restore_id])
            return None  # a restore that never committed changes nothing
        if tracker is None:
            tracker = self._tracker(episode, partition)
        started, finished = tracker.first_offset is not None, tracker.finished
        if tracker.observe(offset, meta, record, start):
            self._dirty[partition].add(episode)
            if not started and tracker.first_offset is not None:
                self.new_starts.append(EpisodeStart(episode, partition, offset, meta["ts"]))
            if tracker.finished and not finished:
                self.new_finishes.append(_finish(tracker, meta, record, start))
        capture = self._capture
        if capture is not None and episode in capture.waiting:
            self._check_wait(capture, tracker, offset)
        return None

    def begun_after(self, markers: Mapping[int, int], known: Container[str]) -> dict[str, int]:
        """Episodes of the owned partitions (with their current attempt) whose first event is at
        or past their partition's marker and that ``known`` (a checkpoint's manifest) does not
        name."""
        owned = self.owned
        return {
            episode: tracker.attempt
            for episode, tracker in self.trackers.items()
            if tracker.partition in owned
            and tracker.first_offset is not None
            and tracker.first_offset >= markers.get(tracker.partition, math.inf)
            and episode not in known
            and episode not in self.retired
        }

    def _forget(self, episode: str) -> None:
        tracker = self.trackers.pop(episode, None)
        if tracker is not None:
            self.by_partition[tracker.partition].pop(episode, None)
            self._dirty[tracker.partition].add(episode)

    def live_episodes(self) -> int:
        return sum(1 for tracker in self.trackers.values() if not tracker.finished)


def _finish(
    tracker: EpisodeTracker, meta: dict[str, Any], record: bytes, start: int
) -> EpisodeFinish:
    """The finish the catalog records, with the result's raw JSON (``record[start:]``) for the
    trainer's results."""
    return EpisodeFinish(
        tracker.episode,
        tracker.attempt,
        meta["ts"],
        tracker.partition,
        tracker.finished_offset,
        tracker.reward,
        record[start:] if start < len(record) else None,
    )


def _fold_failure(error: Exception) -> str:
    return f"the fold could not apply it: {type(error).__name__}: {error}"
