"""The projector: follows every partition of a run and keeps what a manifest needs per episode.

It reads records as metadata only (the payload stays in the record, counted by size), applies the
fold's rules through ``EpisodeTracker``, and answers two questions of the coordinator:

- at a ``checkpoint.marker``: the manifest entries of the partition's episodes at that exact
  position in the partition's order (participants never pause; later events are simply after it);
- at an ``attempt.started``: whether its restore committed (the coordinator says so; the record
  is written before the catalog commit, so the partition waits for the verdict).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
from collections.abc import Awaitable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import EpisodeFinish, EpisodeStart, ManifestEntry
from rolloutlog.log import Log, partition_for, record_meta
from rolloutlog.log._codec import record_restore_id
from rolloutlog.projections._fold import _Filters, select_records
from rolloutlog.projections._model import EpisodeProjection
from rolloutlog.projections._tracker import EpisodeTracker

logger = logging.getLogger(__name__)

#: How many committed checkpoints' capture versions a projector keeps (retention keeps two).
_CAPTURES_KEPT = 2

__all__ = ["CheckpointCapture", "Projector", "RestoreReset"]


@dataclass
class CheckpointCapture:
    """The projector's half of one checkpoint: filled in as each partition reaches its marker."""

    checkpoint_id: int
    partitions: int
    markers: dict[int, int] = field(default_factory=dict)
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    #: Per partition, the earliest offset a live (continue or restart) episode needs.
    needed: dict[int, int] = field(default_factory=dict)
    #: Why an episode restarts, for those that do.
    reasons: dict[str, str] = field(default_factory=dict)
    #: Episodes whose cut waits for a boundary: episode → (owners awaited, marker offset).
    waiting: dict[str, tuple[set[str], int]] = field(default_factory=dict)
    #: Each continued episode's tracker version at its cut (see ``Projector.pin_cut_states``).
    versions: dict[str, int] = field(default_factory=dict)
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    resolved: asyncio.Event = field(default_factory=asyncio.Event)

    def _check(self) -> None:
        if len(self.markers) == self.partitions:
            self.reached.set()
            if not self.waiting:
                self.resolved.set()

    def expire_waits(self, reason: str) -> None:
        """The deadline passed: every episode still waiting for its boundary restarts."""
        for episode, (_, marker) in list(self.waiting.items()):
            old = self.entries.get(episode)
            if old is not None:
                self.entries[episode] = old._replace(
                    action="restart", cut_offset=marker, staging_keys=()
                )
                self.reasons[episode] = reason
        self.waiting.clear()
        self.resolved.set()


@dataclass(frozen=True, slots=True)
class RestoreReset:
    """What a committed restore does to one episode's tracker."""

    action: str  # continue | restart | excluded
    attempt: int
    projection: EpisodeProjection | None = None
    #: Instead of a projection: the episode's tracker, pinned at the cut (``pin_cut_states``).
    pinned: EpisodeTracker | None = None


class Projector:
    """Follows one run's partitions; one instance per run per service."""

    def __init__(self, log: Log, run: str, partitions: int) -> None:
        self.log = log
        self.run = run
        self.partitions = partitions
        self.trackers: dict[str, EpisodeTracker] = {}
        self.by_partition: list[dict[str, EpisodeTracker]] = [{} for _ in range(partitions)]
        self.applied: list[int] = [0] * partitions
        #: Episodes that need no tracking any more (reported finished, or excluded).
        self.retired: set[str] = set()
        self.committed_restores: set[int] = set()
        #: Committed restores whose resets this projector applied itself (``end_restore``).
        self._applied_restores: set[int] = set()
        #: Per committed checkpoint this projector captured: continued episodes' versions.
        self._captured: dict[int, dict[str, int]] = {}
        self._pinned: list[EpisodeTracker] = []
        self._inflight_restores: dict[int, asyncio.Future[bool]] = {}
        self._restore_resets: dict[int, Mapping[str, RestoreReset]] = {}
        self._capture: CheckpointCapture | None = None
        self._progress = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None
        self.events_applied = 0
        #: Starts and finishes not yet recorded in the catalog's episodes table (for analysts).
        self.new_starts: list[EpisodeStart] = []
        self.new_finishes: list[EpisodeFinish] = []

    # -- lifecycle -------------------------------------------------------------------------

    async def start(
        self,
        start_offsets: list[int],
        *,
        committed_restores: Iterable[int] = (),
        retired: Iterable[str] = (),
        refold: Mapping[str, int] | None = None,
        reported_below: Sequence[int] | None = None,
    ) -> None:
        """Catch up from ``start_offsets`` to the current end, then follow in the background.

        ``refold`` names episodes a committed restore continued or restarted, with the attempt
        it made current: their trackers are rebuilt from their records with the fold's
        selection (the cut truncation needs their history; a restarted one's records may start
        after its restore).
        ``reported_below`` holds the latest committed checkpoint's markers: an episode that
        finished below its partition's marker was reported by that checkpoint or an earlier one,
        and is not tracked again.
        """
        self.committed_restores.update(committed_restores)
        self.retired.update(retired)
        self.applied = list(start_offsets)
        ends = await self.log.end_offsets(self.run)
        refolding = dict(refold or {})
        buffered: dict[str, list[tuple[int, dict[str, Any], bytes | None]]] = {}
        logged: dict[tuple[str, int], bytes] = {}
        for partition in range(self.partitions):
            async for offset, record in self.log.read_records(
                self.run, partition, start_offsets[partition], ends[partition]
            ):
                meta = record_meta(record)
                episode = meta.get("episode")
                if episode in refolding:
                    buffered.setdefault(episode, []).append((offset, meta, None))
                    logged[(episode, offset)] = record
                else:
                    verdict = self._apply(partition, offset, meta, record, catching_up=True)
                    if verdict is not None:
                        await verdict
                self.applied[partition] = offset + 1
            self.applied[partition] = max(self.applied[partition], ends[partition])
        for episode, records in buffered.items():
            kept, attempt = select_records(
                records, math.inf, self.committed_restores, refolding[episode]
            )
            tracker = self._tracker(episode, partition_for(episode, self.partitions))
            tracker.filters = _refold_filters(records, attempt)
            for offset, meta, _ in kept:
                tracker.apply(offset, meta, logged[(episode, offset)])
            tracker.attempt = attempt
        if reported_below is not None:
            for episode, tracker in list(self.trackers.items()):
                if (
                    tracker.finished
                    and (tracker.finished_offset or 0) < reported_below[tracker.partition]
                ):
                    self._forget(episode)
                    self.retired.add(episode)
        # What catching up built lives on: keep the cyclic collector from walking it again.
        gc.freeze()
        for partition in range(self.partitions):
            self._tasks.append(asyncio.create_task(self._follow(partition)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _follow(self, partition: int) -> None:
        try:
            async for page in self.log.follow(self.run, partition, self.applied[partition]):
                applied = self.applied
                apply = self._apply
                own_restores = self._applied_restores
                for offset, record in page:
                    if offset < applied[partition]:
                        continue
                    if own_restores and record_restore_id(record) in own_restores:
                        # This projector applied the restore's resets when it committed: its
                        # 16,000 records change nothing more, so skip them undecoded.
                        self.events_applied += 1
                        applied[partition] = offset + 1
                        continue
                    verdict = apply(partition, offset, record_meta(record), record)
                    if verdict is not None:  # an in-flight restore's record: wait for it
                        await verdict
                    applied[partition] = offset + 1
                async with self._progress:
                    self._progress.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # keep the reason for whoever waits on the projector
            logger.exception("projector of run %s, partition %d failed", self.run, partition)
            self._failure = e
            if self._capture is not None:
                self._capture.reached.set()
                self._capture.resolved.set()
            raise

    async def wait_until(self, offsets: Mapping[int, int]) -> None:
        """Wait until every partition has applied everything below the given offsets."""

        def reached() -> bool:
            return all(self.applied[p] >= o for p, o in offsets.items())

        async with self._progress:
            await self._progress.wait_for(lambda: reached() or self._failure is not None)
        if self._failure is not None:
            raise self._failure

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
        catching_up: bool = False,
    ) -> Awaitable[None] | None:
        """Apply one record at once; only the ``attempt.started`` of a restore whose verdict is
        still out returns something to await (synchronous otherwise: a restore's 16,000 records
        follow each other without a coroutine each)."""
        self.events_applied += 1
        kind = meta["type"]
        if kind == "checkpoint.marker":
            if not catching_up:
                self._on_marker(partition, offset, meta["data"]["checkpoint_id"])
            return None
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
        tracker = self._tracker(episode, partition)
        started, finished = tracker.first_offset is not None, tracker.finished
        tracker.observe(offset, meta, record)
        if not started and tracker.first_offset is not None:
            self.new_starts.append(EpisodeStart(episode, partition, offset, meta["ts"]))
        if tracker.finished and not finished:
            self.new_finishes.append(EpisodeFinish(episode, tracker.attempt, meta["ts"]))
        capture = self._capture
        if capture is not None and episode in capture.waiting:
            self._check_wait(capture, tracker, offset)
        return None

    async def _after_verdict(
        self, partition: int, meta: dict[str, Any], verdict: asyncio.Future[bool]
    ) -> None:
        if await verdict and meta["episode"] not in self.retired:
            self._on_attempt_started(partition, meta)

    def _on_attempt_started(self, partition: int, meta: dict[str, Any]) -> None:
        """A committed restore's record (excluded episodes are retired before this)."""
        tracker = self._tracker(meta["episode"], partition)
        # The restore's own resets were applied when it committed (``end_restore``); what is left
        # is a restore seen while catching up after a restart (the start-up refold handles it).
        if meta["attempt"] > tracker.filters.attempt:
            tracker.filters.attempt = meta["attempt"]
            tracker.attempt = meta["attempt"]
            tracker.exact = False  # not reset to the restore's cut: its verdicts replay

    def begun_after(self, markers: Mapping[int, int], known: Container[str]) -> dict[str, int]:
        """Episodes (with their current attempt) whose first event is at or past their
        partition's marker and that ``known`` (a checkpoint's manifest) does not name."""
        return {
            episode: tracker.attempt
            for episode, tracker in self.trackers.items()
            if tracker.first_offset is not None
            and tracker.first_offset >= markers.get(tracker.partition, math.inf)
            and episode not in known
            and episode not in self.retired
        }

    def _forget(self, episode: str) -> None:
        tracker = self.trackers.pop(episode, None)
        if tracker is not None:
            self.by_partition[tracker.partition].pop(episode, None)

    # -- checkpoints -----------------------------------------------------------------------

    def begin_capture(self, checkpoint_id: int) -> CheckpointCapture:
        """Register the checkpoint whose markers are about to be written."""
        capture = CheckpointCapture(checkpoint_id, self.partitions)
        self._capture = capture
        return capture

    def end_capture(self, capture: CheckpointCapture, committed: bool) -> None:
        """The checkpoint committed (finished episodes are reported: stop tracking them) or not."""
        if self._capture is capture:
            self._capture = None
        if committed:
            self._captured[capture.checkpoint_id] = capture.versions
            for old in sorted(self._captured)[:-_CAPTURES_KEPT]:
                del self._captured[old]
            for entry in capture.entries.values():
                if entry.action == "finished":
                    self._forget(entry.episode)
                    self.retired.add(entry.episode)

    def _on_marker(self, partition: int, offset: int, checkpoint_id: int) -> None:
        capture = self._capture
        if capture is None or capture.checkpoint_id != checkpoint_id:
            return  # a marker of a checkpoint this service is not taking (aborted, or stale)
        with collector_paused():
            self._capture_partition(capture, partition, offset)
        capture._check()

    def _capture_partition(self, capture: CheckpointCapture, partition: int, offset: int) -> None:
        capture.markers[partition] = offset
        entries = capture.entries
        needed = offset
        # One tuple per episode straight from the tracker's fields (``_entry`` inlined: this loop
        # runs for every live episode of the partition while the checkpoint waits).
        new, entry_type = tuple.__new__, ManifestEntry
        versions = capture.versions
        for episode, tracker in self.by_partition[partition].items():
            first = tracker.first_offset
            if first is None and not tracker.attempt:
                continue
            if tracker.finished:
                entries[episode] = _entry(tracker, "finished", offset)
                continue
            if first is not None and first < needed:
                needed = first
            if tracker.open_waits:
                action = "continue"
                capture.waiting[episode] = (set(tracker.open_waits), offset)
            elif tracker.restart_only_open:
                action = "restart"
                capture.reasons[episode] = "a restart_only session is open at the cut"
            elif first is None:
                action = "restart"
                capture.reasons[episode] = "the attempt has recorded nothing yet"
            else:
                action = "continue"
                versions[episode] = tracker.version
            entries[episode] = new(
                entry_type,
                (
                    episode,
                    tracker.attempt,
                    action,
                    partition,
                    offset,
                    tracker.last_stage,
                    tracker.referenced_staging_keys(),
                    tracker.size_bytes,
                ),
            )
        capture.needed[partition] = needed

    def _check_wait(self, capture: CheckpointCapture, tracker: EpisodeTracker, offset: int) -> None:
        owners, _ = capture.waiting[tracker.episode]
        if owners & set(tracker.open_waits):
            return
        del capture.waiting[tracker.episode]
        if tracker.finished:
            action = "finished"
        elif tracker.restart_only():
            action = "restart"
            capture.reasons[tracker.episode] = "a restart_only session is open at the cut"
        else:
            action = "continue"
            capture.versions[tracker.episode] = tracker.version
        capture.entries[tracker.episode] = _entry(tracker, action, offset + 1)
        if not capture.waiting and len(capture.markers) == capture.partitions:
            capture.resolved.set()

    # -- restores --------------------------------------------------------------------------

    def begin_restore(self, restore_id: int, resets: Mapping[str, RestoreReset]) -> None:
        """Register a restore before its ``attempt.started`` records are written."""
        self._inflight_restores[restore_id] = asyncio.get_running_loop().create_future()
        self._restore_resets[restore_id] = resets

    def end_restore(self, restore_id: int, committed: bool) -> None:
        """The restore's catalog transaction committed (or failed): apply its resets at once (old
        attempts' later records are fenced by the new attempt, and the new attempt writes nothing
        before its ``attempt.started``), then release the partitions waiting for the verdict."""
        future = self._inflight_restores.pop(restore_id, None)
        resets = self._restore_resets.pop(restore_id, {})
        if committed:
            self.committed_restores.add(restore_id)
            self._applied_restores.add(restore_id)
            with collector_paused():
                for episode, reset in resets.items():
                    self._reset(episode, reset)
        self.release_pins()
        if future is not None and not future.done():
            future.set_result(committed)

    def _reset(self, episode: str, reset: RestoreReset) -> None:
        if reset.action == "excluded":
            self._forget(episode)
            self.retired.add(episode)
            return
        tracker = self._tracker(episode, partition_for(episode, self.partitions))
        if reset.action == "continue" and reset.pinned is not None:
            tracker.continue_from_pin(reset.attempt)
        elif reset.action == "continue" and reset.projection is not None:
            tracker.continue_from(reset.projection, reset.attempt)
        else:
            tracker.restart(reset.attempt)

    def pin_cut_states(
        self, checkpoint_id: int, entries: Iterable[ManifestEntry]
    ) -> dict[str, EpisodeTracker]:
        """The trackers of the ``continue`` entries that have not changed since this projector
        captured the checkpoint (and are exactly the fold's state), pinned: their state at the
        cut stays readable (``pinned_state``) until the restore ends. A restore takes their
        verdicts from these instead of replaying their records."""
        versions = self._captured.get(checkpoint_id)
        if not versions:
            return {}
        trackers = self.trackers
        out: dict[str, EpisodeTracker] = {}
        for entry in entries:
            tracker = trackers.get(entry.episode)
            if (
                tracker is not None
                and tracker.exact
                and not tracker.finished
                and tracker.attempt == entry.attempt
                and versions.get(entry.episode) == tracker.version
            ):
                tracker.pin()
                out[entry.episode] = tracker
        self._pinned.extend(out.values())
        return out

    def release_pins(self) -> None:
        """The restore that pinned trackers ended (committed or not)."""
        for tracker in self._pinned:
            tracker.unpin()
        self._pinned.clear()

    def live_episodes(self) -> int:
        return sum(1 for tracker in self.trackers.values() if not tracker.finished)


def _entry(tracker: EpisodeTracker, action: str, cut: int) -> ManifestEntry:
    return ManifestEntry(
        tracker.episode,
        tracker.attempt,
        action,  # type: ignore[arg-type]
        tracker.partition,
        cut,
        tracker.last_stage,
        tracker.referenced_staging_keys() if action != "finished" else (),
        tracker.size_bytes,
    )


def _refold_filters(
    records: list[tuple[int, dict[str, Any], bytes | None]], attempt: int
) -> _Filters:
    """The filter state after a whole history (so later zombies and duplicates stay filtered)."""
    filters = _Filters()
    for _, meta, _ in records:
        if meta["type"] not in ("attempt.started", "checkpoint.marker"):
            filters.admits(meta)
    filters.attempt = attempt
    return filters
