"""The projector: follows the partitions of a run that this service replica owns (all of them
for a lone replica) and keeps what a manifest needs per episode.

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
import random
import time
from collections.abc import (
    Awaitable,
    Callable,
    Container,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import (
    QUARANTINE_FIRST_BYTES,
    EpisodeFinish,
    EpisodeStart,
    ManifestEntry,
    QuarantinedRecord,
)
from rolloutlog.core import EpisodeProjection, EventFilters
from rolloutlog.errors import BackendUnavailable, RolloutlogError, RunLost, UnknownRun
from rolloutlog.log import (
    Log,
    partition_for,
    peek_record,
    record_payload_start,
    record_restore_id,
)
from rolloutlog.projections._fold import select_records
from rolloutlog.projections._quarantine import metadata_problem
from rolloutlog.projections._tracker import EpisodeTracker

logger = logging.getLogger(__name__)

#: How many committed checkpoints' entry versions a projector keeps (retention keeps two).
_CAPTURES_KEPT = 2
#: A checkpoint's ``Versions`` is flattened into one dict after this many layers.
_VERSIONS_DEPTH = 8
#: The longest a new capture waits for the outcome of the one before, whose parts are written.
_OUTCOME_WAIT_S = 5.0
#: The longest the projector applies records without letting the event loop run: a page holds up
#: to 8 MiB of records, and a page of tiny events took seconds, /healthz included.
_YIELD_EVERY_S = 0.02

__all__ = [
    "CheckpointCapture",
    "ManifestBase",
    "Projector",
    "RestoreReset",
    "RunHealth",
    "StartPlan",
]


class Versions(Mapping[str, int]):
    """A committed checkpoint's entries' tracker versions (``CheckpointCapture.seen``, whole):
    what its capture changed, laid over the previous checkpoint's. The previous one's stay
    readable as they were (a restore pins its versions, ``Projector.pin_cut_states``) without a
    copy of every live episode's version per checkpoint (64,000 of them took 3-5 ms of each
    checkpoint's manifest stage); every ``_VERSIONS_DEPTH`` layers they are flattened into one
    dict. Only ``get`` is cheap; the rest of ``Mapping`` flattens."""

    __slots__ = ("_depth", "_own", "_parent")

    def __init__(
        self, own: dict[str, int | None], parent: Versions | None = None, depth: int = 0
    ) -> None:
        #: Each changed episode's version, or None: no longer in the manifest.
        self._own = own
        self._parent = parent
        self._depth = depth

    @classmethod
    def over(cls, parent: Mapping[str, int], changes: dict[str, int | None]) -> Versions:
        if isinstance(parent, Versions) and parent._depth < _VERSIONS_DEPTH:
            return cls(changes, parent, parent._depth + 1)
        flat = parent._flat() if isinstance(parent, Versions) else dict(parent)
        for episode, version in changes.items():
            if version is None:
                flat.pop(episode, None)
            else:
                flat[episode] = version
        return cls(cast(dict[str, int | None], flat))

    def get(self, episode: str, default: Any = None) -> Any:
        node: Versions | None = self
        while node is not None:
            version = node._own.get(episode, _ABSENT)
            if version is not _ABSENT:
                return default if version is None else version
            node = node._parent
        return default

    def __getitem__(self, episode: str) -> int:
        version = self.get(episode)
        if version is None:
            raise KeyError(episode)
        return cast(int, version)

    def _flat(self) -> dict[str, int]:
        layers: list[dict[str, int | None]] = []
        node: Versions | None = self
        while node is not None:
            layers.append(node._own)
            node = node._parent
        flat = cast(dict[str, int], dict(layers.pop()))  # the bottom layer holds no None
        for layer in reversed(layers):
            for episode, version in layer.items():
                if version is None:
                    flat.pop(episode, None)
                else:
                    flat[episode] = version
        return flat

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())


_ABSENT = object()


@dataclass
class CheckpointCapture:
    """The projector's half of one checkpoint: filled in as each partition it owns reaches its
    marker (the other partitions' owners capture theirs)."""

    checkpoint_id: int
    owned: frozenset[int]
    markers: dict[int, int] = field(default_factory=dict)
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    #: Per partition, the earliest offset a live (continue or restart) episode needs.
    needed: dict[int, int] = field(default_factory=dict)
    #: Why an episode restarts, for those that do.
    reasons: dict[str, str] = field(default_factory=dict)
    #: Episodes whose cut waits for a boundary: episode → (owners awaited, marker offset).
    waiting: dict[str, tuple[set[str], int]] = field(default_factory=dict)
    #: Each entry's tracker version when it was decided (waits that expired are decided by the
    #: clock: absent): an entry stands while its tracker stays at that version (the next
    #: checkpoint keeps it; a restore pins it, see ``Projector.pin_cut_states``).
    seen: dict[str, int] = field(default_factory=dict)
    #: The committed checkpoint this one amends: ``entries`` then hold only the episodes whose
    #: trackers changed since its markers, ``gone`` those of its entries no longer tracked.
    base: ManifestBase | None = None
    gone: list[str] = field(default_factory=list)
    #: Set by ``compose``: the whole manifest, and each of its entries' ``seen`` version.
    whole: dict[str, ManifestEntry] | None = None
    whole_seen: Mapping[str, int] | None = None
    #: The whole manifest's ``continue``/``restart``/``finished`` counts and ``size_bytes``,
    #: and how many of its entries reference each staging key.
    totals: dict[str, int] = field(default_factory=dict)
    staging: dict[str, int] = field(default_factory=dict)

    def compose(self) -> dict[str, ManifestEntry]:
        """The whole manifest: the base's, amended in place by this capture's entries (no
        Python pass over the live episodes; a base whose next checkpoint fails is dropped, see
        ``Projector.end_capture``). ``seen`` is laid over the base's (``Versions``): the base's
        stays as the versions of its own checkpoint (``pin_cut_states``)."""
        if self.whole is not None:
            return self.whole
        base = self.base
        if base is None:
            self.whole, self.whole_seen = self.entries, self.seen
            return self.entries
        whole = base.entries
        whole.update(self.entries)
        changes: dict[str, int | None] = dict(self.seen)
        for episode in self.gone:
            whole.pop(episode, None)
            changes[episode] = None
        for episode in self.entries.keys() - self.seen.keys():  # waits that expired
            changes[episode] = None
        self.whole, self.whole_seen = whole, Versions.over(base.seen, changes)
        return whole

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    resolved: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by ``Projector.end_capture``: the outcome is known.
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def _check(self) -> None:
        if len(self.markers) == len(self.owned):
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
                self.reasons.setdefault(episode, reason)  # a more precise one may be there
        self.waiting.clear()
        self.resolved.set()


@dataclass(frozen=True, slots=True)
class ManifestBase:
    """The newest checkpoint this projector captured and saw commit: its whole manifest, and
    how its stored manifest is chained (``depth`` deltas since a whole one, ``amended`` entries
    written in those deltas)."""

    checkpoint_id: int
    entries: dict[str, ManifestEntry]
    seen: Mapping[str, int]
    #: Per partition, the ``replay_from`` it committed: a delta keeps the smaller of it and its
    #: changed episodes' first offsets (never above the true one; exact again once whole).
    needed: Mapping[int, int]
    depth: int
    amended: int
    totals: Mapping[str, int]
    staging: dict[str, int]


@dataclass(frozen=True, slots=True)
class RestoreReset:
    """What a committed restore does to one episode's tracker."""

    action: str  # continue | restart | excluded
    attempt: int
    projection: EpisodeProjection | None = None
    #: Instead of a projection: the episode's tracker, pinned at the cut (``pin_cut_states``).
    pinned: EpisodeTracker | None = None


#: How a run's projector is doing (``RunHealth.status``): ``ok``; ``degraded`` (it hit an error and
#: retries with backoff: it recovers by itself); ``stopped`` (it cannot go on without an operator).
HealthStatus = Literal["ok", "degraded", "stopped"]
#: A projector's ``degraded`` error until its first catch-up with the log ended.
STARTING = "starting: catching up with the log"

#: Backoff of a projector that failed: transient errors from 0.1 s up to 5 s, others (a
#: non-retriable error that persists) from 1 s up to 30 s; each delay jittered by half.
_BACKOFF_TRANSIENT = (0.1, 5.0)
_BACKOFF_PERSISTENT = (1.0, 30.0)


@dataclass(frozen=True, slots=True)
class RunHealth:
    """A run projector's health, as ``GET /v1/runs/{run}`` and ``/readyz`` report it."""

    status: HealthStatus
    error: str | None
    #: Since when (unix time) the status holds.
    since: float

    def view(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "since": self.since}


@dataclass(frozen=True, slots=True)
class StartPlan:
    """Where a projector starts and what the catalog says about what it will read."""

    start_offsets: list[int]
    committed_restores: Iterable[int] = ()
    retired: Iterable[str] = ()
    #: Episodes a committed restore continued or restarted, with the attempt it made current:
    #: their trackers are rebuilt from their records with the fold's selection (the cut
    #: truncation needs their history; a restarted one's records may start after its restore).
    refold: Mapping[str, int] = field(default_factory=dict)
    #: The latest committed checkpoint's markers: an episode that finished below its partition's
    #: marker was reported by that checkpoint or an earlier one, and is not tracked again.
    reported_below: Sequence[int] | None = None
    #: Positions (partition, offset) the catalog has quarantined already.
    quarantined: Iterable[tuple[int, int]] = ()
    #: Restores still being planned by the partitions' owners: their verdict is
    #: pending, so their ``attempt.started`` records wait for it (``end_restore``).
    planning_restores: Iterable[int] = ()
    #: The first checkpoint id not over when the plan was made (the pending one's, else the
    #: next): catching up stops short of such a checkpoint's markers, so that they are met
    #: caught up and captured (None: catching up reads to the log's end).
    open_checkpoints_from: int | None = None


def _transient(error: BaseException) -> bool:
    if isinstance(error, RolloutlogError):
        return error.retriable
    return isinstance(error, OSError | TimeoutError | ConnectionError)


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if isinstance(error, RolloutlogError) else f"{type(error).__name__}: {text}"


class Projector:
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
        #: Committed restores whose resets this projector applied itself (``end_restore``).
        self._applied_restores: set[int] = set()
        #: Per committed checkpoint this projector captured: its entries' tracker versions.
        self._captured: dict[int, Mapping[str, int]] = {}
        #: The newest committed capture, which the next checkpoint's manifest amends.
        self._base: ManifestBase | None = None
        #: Per partition, the episodes whose trackers changed (or went) since the last marker
        #: captured there: all a capture that amends a base looks at.
        self._dirty: list[set[str]] = [set() for _ in range(partitions)]
        self._pinned: list[EpisodeTracker] = []
        #: Whose plan pinned ``_pinned`` (one restore at a time), and per in-flight restore the
        #: holder of the pins it planned with.
        self._pin_holder: object | None = None
        self._pins_of: dict[int, object] = {}
        self._inflight_restores: dict[int, asyncio.Future[bool]] = {}
        self._restore_resets: dict[int, Mapping[str, RestoreReset] | None] = {}
        self._capture: CheckpointCapture | None = None
        #: The newest checkpoint id this projector has seen a capture or a marker of.
        self._newest_checkpoint = 0
        #: Told of each capture begun at a marker of another replica's checkpoint.
        self.on_remote_capture: Callable[[CheckpointCapture], object] | None = None
        self._progress = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.events_applied = 0
        #: Starts and finishes not yet recorded in the catalog's episodes table (for analysts).
        self.new_starts: list[EpisodeStart] = []
        self.new_finishes: list[EpisodeFinish] = []
        #: Quarantined records not yet recorded in the catalog, and every quarantined position.
        self.new_quarantined: list[QuarantinedRecord] = []
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
        replicas write markers and appends into every partition)."""
        ends = await self.log.latest_offsets(self.run)
        applied = self.applied
        held = self._held
        for partition in sorted(self.owned):
            if applied[partition] < ends[partition] and partition not in held:
                pages = self.log.read_pages(
                    self.run, partition, applied[partition], ends[partition]
                )
                async for page in pages:
                    for offset, record in page:
                        if offset < applied[partition]:
                            continue
                        verdict = self._take(partition, offset, record)
                        if verdict is not None:
                            await verdict
                        if partition in held:  # an open checkpoint's marker: met again later
                            self.events_applied -= 1
                            break
                        applied[partition] = offset + 1
                    if partition in held:
                        aclose = getattr(pages, "aclose", None)
                        if aclose is not None:
                            await aclose()
                        break
            if partition not in held:
                applied[partition] = max(applied[partition], ends[partition])
        async with self._progress:
            self._progress.notify_all()

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
            health = self.health
            why = f" ({health.status}: {health.error})" if health.status != "ok" else ""
            raise BackendUnavailable(
                f"the projector of run {self.run!r} did not reach the log's offsets within "
                f"{timeout_s} s{why}; retry",
                run=self.run,
                health=health.view(),
            ) from e
        self.check_running()

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
        tracker.fence_to(meta["attempt"])
        self._dirty[partition].add(meta["episode"])

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

    # -- checkpoints -----------------------------------------------------------------------

    def begin_capture(self, checkpoint_id: int) -> CheckpointCapture:
        """Register the checkpoint whose markers are about to be written (or, another replica's,
        whose first marker in an owned partition is being applied). A capture still registered is of
        an older checkpoint that is over (one is pending at a time): it ends uncommitted."""
        if self._capture is not None:
            self.end_capture(self._capture, committed=False)
        capture = CheckpointCapture(checkpoint_id, self.owned, base=self._base)
        capture._check()  # owning no partition, it has reached every marker it will
        self._capture = capture
        self._newest_checkpoint = max(self._newest_checkpoint, checkpoint_id)
        return capture

    def end_capture(
        self, capture: CheckpointCapture, committed: bool, *, depth: int = 0, amended: int = 0
    ) -> None:
        """The checkpoint committed (finished episodes are reported: stop tracking them; its
        manifest is stored ``depth`` deltas after a whole one, ``amended`` entries in those) or
        not (the next manifest is written whole: a commit whose reply was lost may be in the
        catalog all the same). A capture no longer registered (a newer one replaced it) changes
        nothing: the base is the newest capture's business."""
        capture.ended.set()
        if self._capture is not capture:
            return
        self._capture = None
        self._base = None
        if committed:
            whole = capture.whole if capture.whole is not None else capture.compose()
            seen = capture.whole_seen if capture.whole_seen is not None else capture.seen
            self._base = ManifestBase(
                capture.checkpoint_id,
                whole,
                seen,
                dict(capture.needed),
                depth,
                amended,
                capture.totals,
                capture.staging,
            )
            self._captured[capture.checkpoint_id] = seen
            for old in sorted(self._captured)[:-_CAPTURES_KEPT]:
                del self._captured[old]
            for entry in capture.entries.values():
                if entry.action == "finished":
                    self._forget(entry.episode)
                    self.retired.add(entry.episode)

    def _on_marker(self, partition: int, offset: int, checkpoint_id: int) -> Awaitable[None] | None:
        """A marker (of an owned partition: others are not captured here). The first one met
        after catching up of a checkpoint newer than any known, with no capture registered for
        it, begins a capture: another replica's checkpoint. While catching up none is captured
        (the refold's buffers make trackers inexact there): the marker of a checkpoint that was
        not over when the start was planned holds its partition there (``_read_to_end`` stops
        short of it, and the follower meets it again caught up); any other is over already. A
        capture still registered whose parts are written waits for its outcome first (returned
        to await): it decides the new capture's base."""
        if partition not in self.owned:
            return None
        capture = self._capture
        newest = self._newest_checkpoint
        if not self.caught_up:
            if self._open_from is not None and checkpoint_id >= self._open_from:
                self._held.add(partition)
            else:
                self._newest_checkpoint = max(newest, checkpoint_id)
            return None
        self._newest_checkpoint = max(newest, checkpoint_id)
        if capture is None or capture.checkpoint_id != checkpoint_id:
            if checkpoint_id <= newest or self.on_remote_capture is None:
                return None  # a marker of a checkpoint that is over (aborted, or stale)
            if capture is not None and capture.resolved.is_set() and not capture.ended.is_set():
                return self._remote_after_outcome(partition, offset, checkpoint_id)
            self._begin_remote(partition, offset, checkpoint_id)
            return None
        self._capture_at(capture, partition, offset)
        return None

    async def _remote_after_outcome(self, partition: int, offset: int, checkpoint_id: int) -> None:
        await self.capture_outcome()
        self._begin_remote(partition, offset, checkpoint_id)

    def _begin_remote(self, partition: int, offset: int, checkpoint_id: int) -> None:
        capture = self.begin_capture(checkpoint_id)
        assert self.on_remote_capture is not None
        self.on_remote_capture(capture)
        self._capture_at(capture, partition, offset)

    def _capture_at(self, capture: CheckpointCapture, partition: int, offset: int) -> None:
        with collector_paused():
            self._capture_partition(capture, partition, offset)
        capture._check()

    async def capture_outcome(self) -> None:
        """Wait (up to ``_OUTCOME_WAIT_S``) for the registered capture, if its parts are written
        (or being written), to learn its outcome: a checkpoint after it amends it only if it
        committed. (One with parts still to write is over: a newer checkpoint began, so it
        aborted; the next capture replaces it.)"""
        capture = self._capture
        if capture is not None and capture.resolved.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_OUTCOME_WAIT_S):
                    await capture.ended.wait()

    def _capture_partition(self, capture: CheckpointCapture, partition: int, offset: int) -> None:
        capture.markers[partition] = offset
        entries = capture.entries
        dirty, self._dirty[partition] = self._dirty[partition], set()
        trackers = self.by_partition[partition]
        base = capture.base
        needed = offset
        pairs: Iterable[tuple[str, EpisodeTracker]] = trackers.items()
        before: Mapping[str, int] = {}
        if base is not None:
            # What changed since the base's markers: the other entries stand (see ``seen``).
            needed = min(offset, base.needed.get(partition, offset))
            before = base.seen
            pairs = [(e, trackers[e]) for e in dirty if e in trackers]
            capture.gone.extend(e for e in dirty if e not in trackers and e in base.entries)
        # One tuple per episode straight from the tracker's fields (``_entry`` inlined: on a
        # first capture this loop runs for every live episode of the partition while the
        # checkpoint waits); the action is the fold's capture rule (``EpisodeFold.at_cut``).
        new, entry_type = tuple.__new__, ManifestEntry
        seen = capture.seen
        for episode, tracker in pairs:
            version = tracker.version
            if before.get(episode) == version:
                continue  # a record it did not admit: its entry stands
            decision = tracker.at_cut()
            if decision is None:
                if base is not None and episode in base.entries:
                    capture.gone.append(episode)
                continue
            action, reason, waits = decision
            if action == "finished":
                entries[episode] = _entry(tracker, action, offset)
                continue
            first = tracker.first_offset
            if first is not None and first < needed:
                needed = first
            if waits:
                capture.waiting[episode] = (
                    set(tracker.open_waits) | tracker.export_owners(),
                    offset,
                )
            else:
                seen[episode] = version
                if reason is not None:
                    capture.reasons[episode] = reason
            entries[episode] = new(
                entry_type,
                (
                    episode,
                    tracker.attempt,
                    action,
                    partition,
                    offset,
                    tracker.last_stage,
                    tracker.staging_keys_at_cut(),
                    tracker.size_bytes,
                    None,  # the reason, from ``capture.reasons`` when the manifest is written
                ),
            )
        capture.needed[partition] = needed

    def _check_wait(self, capture: CheckpointCapture, tracker: EpisodeTracker, offset: int) -> None:
        owners, _ = capture.waiting[tracker.episode]
        if owners & set(tracker.open_waits) or tracker.export_missing(
            owners, capture.checkpoint_id
        ):
            return
        del capture.waiting[tracker.episode]
        # The awaited boundaries came: the capture rule again, the cut just past this record.
        decision = tracker.at_cut(waits=False)
        if decision is None:  # a restore reset it to nothing meanwhile: no entry, as at a marker
            capture.entries.pop(tracker.episode, None)
            base = capture.base
            if base is not None and tracker.episode in base.entries:
                capture.gone.append(tracker.episode)
        else:
            action, reason, _ = decision
            if reason is not None:
                capture.reasons[tracker.episode] = reason
            if action != "finished":
                capture.seen[tracker.episode] = tracker.version
            capture.entries[tracker.episode] = _entry(tracker, action, offset + 1)
        if not capture.waiting and len(capture.markers) == len(capture.owned):
            capture.resolved.set()

    # -- restores --------------------------------------------------------------------------

    def begin_restore(
        self,
        restore_id: int,
        resets: Mapping[str, RestoreReset] | None,
        pins: object | None = None,
    ) -> None:
        """Register a restore before its ``attempt.started`` records are written (``pins``:
        the holder of the trackers its plan pinned, released when it ends). With ``resets``
        None (a restore that was planning when the projector started), only its verdict is
        awaited: if it commits, its records fence their episodes as they are met."""
        if restore_id not in self._inflight_restores:
            self._inflight_restores[restore_id] = asyncio.get_running_loop().create_future()
        self._restore_resets[restore_id] = resets
        if pins is not None:
            self._pins_of[restore_id] = pins

    @property
    def pending_restores(self) -> list[int]:
        """Restores registered whose verdict is still out."""
        return list(self._inflight_restores)

    def end_restore(self, restore_id: int, committed: bool) -> None:
        """The restore's catalog transaction committed (or failed): apply its resets at once (old
        attempts' later records are fenced by the new attempt, and the new attempt writes nothing
        before its ``attempt.started``), then release the partitions waiting for the verdict."""
        future = self._inflight_restores.pop(restore_id, None)
        resets = self._restore_resets.pop(restore_id, None)
        pins = self._pins_of.pop(restore_id, None)
        if committed:
            self.committed_restores.add(restore_id)
        if committed and resets is not None:
            self._applied_restores.add(restore_id)
            with collector_paused():
                for episode, reset in resets.items():
                    self._reset(episode, reset)
        if pins is not None:
            self.release_pins(pins)
        if future is not None and not future.done():
            future.set_result(committed)

    def _reset(self, episode: str, reset: RestoreReset) -> None:
        if reset.action == "excluded":
            self._forget(episode)
            self.retired.add(episode)
            return
        tracker = self._tracker(episode, partition_for(episode, self.partitions))
        self._dirty[tracker.partition].add(episode)
        if reset.action == "continue" and reset.pinned is not None:
            tracker.continue_at_cut(reset.attempt)
        elif reset.action == "continue" and reset.projection is not None:
            tracker.continue_from(reset.projection, reset.attempt)
        else:
            tracker.restart(reset.attempt)

    def pin_cut_states(
        self, checkpoint_id: int, entries: Iterable[ManifestEntry], holder: object
    ) -> dict[str, EpisodeTracker]:
        """The trackers of the ``continue`` entries that have not changed since this projector
        captured the checkpoint (and are exactly the fold's state), pinned for ``holder``: their
        state at the cut stays readable (``pinned_state``) until ``release_pins(holder)`` (or
        the end of the restore it began with them). A restore takes their verdicts from these
        instead of replaying their records. None while another holder's pins are held (two
        restores of a run planned at once: the later one replays)."""
        versions = self._captured.get(checkpoint_id)
        if versions is None or self._pinned:  # (its entries' versions: a continue's is the cut's)
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
        if out:
            self._pin_holder = holder
        return out

    def release_pins(self, holder: object | None) -> None:
        """The restore (or plan) that pinned trackers for ``holder`` ended (committed or not)."""
        if holder is None or holder is not self._pin_holder:
            return
        for tracker in self._pinned:
            tracker.unpin()
        self._pinned.clear()
        self._pin_holder = None

    def live_episodes(self) -> int:
        return sum(1 for tracker in self.trackers.values() if not tracker.finished)

    # -- what the catalog's feeders take (``_feeders.py``) ------------------------------------

    def has_new_episodes(self) -> bool:
        return bool(self.new_starts or self.new_finishes)

    def take_new_episodes(self, limit: int) -> tuple[list[EpisodeStart], list[EpisodeFinish]]:
        """Up to ``limit`` starts and finishes not yet recorded, oldest first (taken off the
        queue: ``put_back_new_episodes`` if the catalog did not take them)."""
        starts, self.new_starts = self.new_starts[:limit], self.new_starts[limit:]
        finishes, self.new_finishes = self.new_finishes[:limit], self.new_finishes[limit:]
        return starts, finishes

    def put_back_new_episodes(
        self, starts: Sequence[EpisodeStart], finishes: Sequence[EpisodeFinish]
    ) -> None:
        """Back in front of the queue, in order (more may have been queued meanwhile)."""
        self.new_starts[:0] = starts
        self.new_finishes[:0] = finishes

    def new_quarantine_batch(self, limit: int) -> list[QuarantinedRecord]:
        """Up to ``limit`` quarantined records not yet recorded (``quarantine_recorded`` once
        the catalog took them)."""
        return self.new_quarantined[:limit]

    def quarantine_recorded(self, count: int) -> None:
        del self.new_quarantined[:count]

    def drop_unrecorded(self) -> None:
        """The run is deleted: nothing more for the catalog."""
        self.new_starts.clear()
        self.new_finishes.clear()
        self.new_quarantined.clear()


def _entry(tracker: EpisodeTracker, action: str, cut: int) -> ManifestEntry:
    return ManifestEntry(
        tracker.episode,
        tracker.attempt,
        action,  # type: ignore[arg-type]
        tracker.partition,
        cut,
        tracker.last_stage,
        tracker.staging_keys_at_cut(),
        tracker.size_bytes,
    )


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
