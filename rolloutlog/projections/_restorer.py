"""Restores (docs/design.md §6, §10 "A restore"): the runner around the pure planner
(``_planner.py``). It fences the controller, reads the checkpoint and its manifest, waits for the
projector, gathers each ``continue`` episode's state at its cut (pinned trackers, else a replay of
the log), asks the planner, opens the restore's request (its id reserved), writes the
``attempt.started`` records and commits the plan in one catalog transaction. A failure anywhere
commits nothing (the request is aborted): the projector discards the restore and the old attempts
stay current. With several replicas each plans the partitions it owns: the requester
its own in-process, the others theirs through ``poll``, as ``restore_parts`` rows that the
requester merges before its commit."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutlog import _malloc
from rolloutlog._gc import collector_paused
from rolloutlog.catalog import (
    Catalog,
    Checkpoint,
    ManifestEntry,
    Restore,
    RestoreEntry,
    RestorePlanning,
)
from rolloutlog.core import (
    EpisodeProjection,
    PlannedEpisode,
    ProjectionLine,
    RestorePlan,
    RestorePolicy,
    apply_policy,
    check_exclusions,
    plan_restore,
    planned_cut_dispositions,
    replay_start,
    to_continue,
)
from rolloutlog.errors import (
    BackendUnavailable,
    InvalidRequest,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRestore,
)
from rolloutlog.log import Log, Record, attempt_started_record, partition_for
from rolloutlog.projections._checkpointer import DEFAULT_WAIT_DEADLINE_S
from rolloutlog.projections._feeders import flush_episodes
from rolloutlog.projections._projector import Projector, RestoreReset, _describe
from rolloutlog.projections._replay import replay_at_cuts, replay_stream
from rolloutlog.projections._start_plan import all_restores
from rolloutlog.projections._timing import StageTimer

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RESTORE_DEADLINE_S",
    "POLL_S",
    "PlanPart",
    "PlanRequest",
    "ProjectionCache",
    "RestoreLines",
    "RestoreResult",
    "Restorer",
]

#: How long the owners of a restore's partitions have to plan their parts: past it any replica
#: aborts the request (its requester waits as long for their parts).
DEFAULT_RESTORE_DEADLINE_S = 60.0
#: How often a replica looks for other replicas' requests and for the verdicts it waits for,
#: while it shares a run's partitions with other replicas or waits for a verdict; alone, every
#: ``POLL_ALONE_S`` (a lone embedded service spent a tenth of a core polling at ``POLL_S``).
POLL_S = 0.05
POLL_ALONE_S = 1.0
#: How often a requester looks for the other owners' parts.
_PARTS_POLL_S = 0.025


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore: Restore
    entries: tuple[RestoreEntry, ...]
    timings_ms: Mapping[str, float]
    #: Generation cuts dropped or restarted, by disposition (``planned_cut_dispositions``).
    cuts: Mapping[str, int] = field(default_factory=dict)


#: What a cached line costs besides its bytes (its tuple, strings and index entry).
_LINE_OVERHEAD = 400
#: How many projections a build encodes before it lets the event loop run.
_ENCODE_SLICE = 256


def _release_freed() -> None:
    """Hand the memory freed by the plan (and by the run's previous restore's lines) back to the
    OS before the lines are built. glibc keeps freed heap pages otherwise: measured on S1, the
    second restore's build then grew RSS on top of ~130 MB freed but held (VmHWM 414 MB with
    the trim's ~390 MB), for a few milliseconds' trim."""
    _malloc.trim()


class RestoreLines:
    """One committed restore's continued projections as NDJSON lines (``ProjectionLine``), as
    its build adds them: any number of fetchers stream them while the build goes on (a
    replay that started while the restore committed, or the plan's own projections)."""

    def __init__(self) -> None:
        self.lines: list[ProjectionLine] = []
        self.by_episode: dict[str, ProjectionLine] = {}
        self.size_bytes = 0
        self.done = False
        self.error: BaseException | None = None
        self._more = asyncio.Event()

    def add(self, line: ProjectionLine) -> None:
        self.lines.append(line)
        self.by_episode[line.episode] = line
        self.size_bytes += len(line.line) + _LINE_OVERHEAD
        self._more.set()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done = True
        self._more.set()

    async def batches(self) -> AsyncIterator[list[ProjectionLine]]:
        """The lines in the order they were built, in batches as they come; the build's error
        if it failed."""
        sent = 0
        while True:
            if sent < len(self.lines):
                batch = self.lines[sent:]
                sent += len(batch)
                yield batch
                continue
            if self.error is not None:
                raise self.error
            if self.done:
                return
            self._more.clear()
            await self._more.wait()

    async def complete(self) -> dict[str, ProjectionLine]:
        """Every line by episode, once the build is done."""
        async for _ in self.batches():
            pass
        return self.by_episode


class ProjectionCache:
    """Committed restores' projection lines within a byte budget (``RestoreLines.size_bytes``).

    A run's newest committed restore supersedes its older ones (their attempts are fenced): they
    are dropped when it is cached (and when a restore of the run begins, so that a restore's
    replay never holds two generations), and rebuilt from the log if asked for again (served
    once, not kept). Over the budget, the other runs' restores go first, oldest first; the
    newest restore put is always kept. Dropping an entry leaves its fetchers streaming it."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._entries: dict[tuple[str, int], RestoreLines] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, run: str, restore_id: int) -> RestoreLines | None:
        return self._entries.get((run, restore_id))

    @property
    def size_bytes(self) -> int:
        return sum(lines.size_bytes for lines in self._entries.values())

    def put(self, run: str, restore_id: int, lines: RestoreLines) -> None:
        newest = max((rid for r, rid in self._entries if r == run), default=-1)
        if restore_id < newest:
            return  # an older restore rebuilt on demand: served once, not kept
        self.forget_run(run)
        self._entries[(run, restore_id)] = lines
        self.trim((run, restore_id))

    def trim(self, keep: tuple[str, int]) -> None:
        """Drop entries other than ``keep``, oldest first, until within the budget."""
        total = self.size_bytes
        for key in sorted(self._entries, key=lambda k: k[1]):
            if total <= self._budget:
                break
            if key != keep:
                total -= self._entries.pop(key).size_bytes

    def drop(self, run: str, restore_id: int, lines: RestoreLines) -> None:
        """Drop ``lines`` if they are still the entry of that restore (a failed build)."""
        if self._entries.get((run, restore_id)) is lines:
            del self._entries[(run, restore_id)]

    def forget_run(self, run: str) -> None:
        for key in [key for key in self._entries if key[0] == run]:
            del self._entries[key]


async def _each(projections: Iterable[EpisodeProjection]) -> AsyncIterator[EpisodeProjection]:
    for index, projection in enumerate(projections, 1):
        yield projection
        if index % _ENCODE_SLICE == 0:
            await asyncio.sleep(0)


async def _with_policy(
    projections: AsyncIterator[EpisodeProjection], policy: RestorePolicy
) -> AsyncIterator[EpisodeProjection]:
    """The continued projections as the restore's plan kept them (its policy drops old cuts)."""
    async for projection in projections:
        yield apply_policy(projection, policy.policy_version, policy.max_policy_lag)[0]


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What a restore's owners plan by (the request row's JSON)."""

    exclude: frozenset[str]
    exclude_results: bool
    policy: RestorePolicy

    def to_json(self) -> dict[str, Any]:
        return {
            "exclude": sorted(self.exclude),
            "exclude_results": self.exclude_results,
            "policy_version": self.policy.policy_version,
            "max_policy_lag": self.policy.max_policy_lag,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanRequest:
        return cls(
            frozenset(data.get("exclude", ())),
            bool(data.get("exclude_results", False)),
            RestorePolicy(data.get("policy_version"), data.get("max_policy_lag")),
        )


@dataclass(slots=True)
class PlanPart:
    """One owner's part of a restore plan: the planned episodes of its partitions, in the plan's
    order, and what its projector does to them if the restore commits."""

    plan: RestorePlan
    #: The part's episodes begun after the checkpoint's markers.
    after: frozenset[str]
    resets: dict[str, RestoreReset]
    #: Generation cuts dropped or restarted (``planned_cut_dispositions``).
    cuts: dict[str, int]
    #: The holder of the trackers the plan pinned (``Projector.pin_cut_states``), if any.
    pins: object | None

    def bodies(self, partitions: int, owned: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The part as ``restore_parts`` rows: per owned partition (every one, planned episodes
        or not) its episodes ``[episode, previous_attempt, attempt, action, reason, cut,
        begun_after]`` and its cut dispositions."""
        episodes: dict[int, list[PlannedEpisode]] = {p: [] for p in owned}
        for planned in self.plan.episodes:
            episodes[partition_for(planned.entry.episode, partitions)].append(planned)
        kept = self.plan.projections
        out = {}
        for partition, planned_here in episodes.items():
            names = {planned.entry.episode for planned in planned_here}
            here = RestorePlan(planned_here, {e: p for e, p in kept.items() if e in names})
            out[partition] = {
                "episodes": [
                    [*p.entry, p.cut, p.entry.episode in self.after] for p in planned_here
                ],
                "cuts": planned_cut_dispositions(here, here.projections),
            }
        return out


def _decode(body: Mapping[str, Any]) -> tuple[list[PlannedEpisode], set[str]]:
    """A ``restore_parts`` row's planned episodes and those of them begun after the markers."""
    planned, after = [], set()
    for episode, previous, attempt, action, reason, cut, begun_after in body["episodes"]:
        planned.append(
            PlannedEpisode(RestoreEntry(episode, previous, attempt, action, reason), cut)
        )
        if begun_after:
            after.add(episode)
    return planned, after


class Restorer:
    """Runs a service's restores, plans its partitions' parts of other replicas' restores, and
    serves the projections of restores and checkpoints."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        projectors: Mapping[str, Projector],
        cache: ProjectionCache,
        *,
        replica_id: str = "local",
        deadline_s: float = DEFAULT_RESTORE_DEADLINE_S,
        owned_now: Callable[[str], Collection[int]] | None = None,
    ) -> None:
        self.log = log
        self.catalog = catalog
        self._projectors = projectors
        self.cache = cache
        self.replica_id = replica_id
        self.deadline_s = deadline_s
        #: The partitions of a run this replica's leases hold now (its projector, relaunched
        #: only once the restore releases the run, may still fold the ones it held before).
        self._owned_now = owned_now
        #: Other replicas' requests this one planned (or is planning), with the projector.
        self._planned: dict[tuple[str, int], Projector] = {}
        #: This replica's requests being run, with the projector that plans them in-process.
        self._requesting: dict[tuple[str, int], Projector] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Projection lines being built (``_build``).
        self._builds: set[asyncio.Task[None]] = set()

    async def restore(
        self,
        projector: Projector,
        controller_epoch: int,
        checkpoint_id: int | str,
        exclude: Iterable[str],
        policy: RestorePolicy,
        exclude_results: bool = False,
        lock: asyncio.Lock | None = None,
    ) -> RestoreResult:
        """Plan and commit a restore of the projector's run under the run's ``lock`` (the run's
        projector is not started afresh meanwhile, nor the run deleted).

        ``exclude_results``: also exclude every episode the plan would continue or restart whose
        finished result the catalog holds (the trainer reads it from the results route).

        The projector plans its own partitions in-process; the owners of the others plan theirs
        when they see the request (``poll``) and write them to the catalog. While it waits for
        their parts the lock is let go: an owner change may start the run's projector afresh
        (the poller then plans the new one's partitions). A projector that owns every partition
        opens the request after its plan (a mistyped exclusion then fails at once) and writes
        no parts: its request row is its only extra cost."""
        lock = lock or asyncio.Lock()
        await lock.acquire()
        try:
            return await self._restore(
                lock,
                self._projectors.get(projector.run, projector),  # the current one, once locked
                controller_epoch,
                checkpoint_id,
                PlanRequest(frozenset(exclude), exclude_results, policy),
            )
        finally:
            lock.release()

    async def _restore(
        self,
        lock: asyncio.Lock,
        projector: Projector,
        controller_epoch: int,
        checkpoint_id: int | str,
        request: PlanRequest,
    ) -> RestoreResult:
        run = projector.run
        timer = StageTimer()
        info = await self.catalog.get_run(run)
        if info.controller_epoch != controller_epoch:
            raise StaleController(
                f"controller epoch {controller_epoch} is stale; run {run!r} is at "
                f"{info.controller_epoch}",
                run=run,
                controller_epoch=controller_epoch,
                current=info.controller_epoch,
            )
        checkpoint = await self.committed_checkpoint(run, checkpoint_id)
        # This restore supersedes the run's earlier ones: their projections go now rather than
        # sit beside this one's replay (rebuilt from the log if still asked for).
        self.cache.forget_run(run)
        manifest = await self.catalog.load_manifest(run, checkpoint.checkpoint_id)
        whole = projector.owned >= frozenset(range(projector.partitions))
        part: PlanPart | None = None
        if whole:
            part = await self.plan_part(projector, checkpoint, manifest, request, timer)
        try:
            restore_id = await self.catalog.open_restore(
                run,
                controller_epoch,
                checkpoint.checkpoint_id,
                requested_by=self.replica_id,
                request=request.to_json(),
                deadline_s=self.deadline_s,
            )
        except BaseException:
            if part is not None:
                projector.release_pins(part.pins)
            raise
        committed = begun = False
        self._requesting[(run, restore_id)] = projector
        try:
            if part is None:
                part = await self.plan_part(projector, checkpoint, manifest, request, timer)
            projector.begin_restore(restore_id, part.resets, part.pins)
            begun = True
            if whole:
                planned, cuts = part.plan.episodes, part.cuts
                fences = {self.replica_id: dict(projector.generations)}
            else:
                lock.release()
                try:
                    planned, cuts, fences = await self._gather(
                        projector, checkpoint.checkpoint_id, manifest, request, restore_id, part
                    )
                finally:
                    await lock.acquire()
                timer.stage("parts")
            # The id was reserved (``open_restore``) before any record names it: a restore that
            # dies before its commit leaves attempt records under an id no later one can commit.
            await self._write_attempts(
                run,
                info.partitions,
                restore_id,
                checkpoint.checkpoint_id,
                planned,
                controller_epoch,
            )
            timer.stage("attempts")
            entries = tuple(p.entry for p in planned)
            restore = await self.catalog.commit_restore(
                run,
                controller_epoch,
                checkpoint.checkpoint_id,
                entries,
                timings_ms=timer.total(),
                restore_id=restore_id,
                fences={r: g for r, g in fences.items() if g},
            )
            committed = True
            timer.stage("commit")
        except BaseException as e:
            if part is not None and not begun:
                projector.release_pins(part.pins)
            await self._abort(run, restore_id, e)
            raise
        finally:
            del self._requesting[(run, restore_id)]
            if begun:
                projector.end_restore(restore_id, committed)
        if whole:
            # The fetch that follows the reply needs every continued projection: their build
            # (replayed, or encoded from the plan's) starts now, not when it asks. (Started
            # before the commit, it held the event loop from the commit: the plan then took as
            # long as the replay.)
            _release_freed()
            build = self._build_planned(run, restore_id, projector, checkpoint, manifest, part)
            self.cache.put(run, restore_id, build)
        # What stays (cached projections, the trackers' new states): keep the collector from
        # walking it again and again.
        gc.freeze()
        return RestoreResult(restore, entries, timer.total(), cuts)

    async def plan_part(
        self,
        projector: Projector,
        checkpoint: Checkpoint,
        manifest: Sequence[ManifestEntry],
        request: PlanRequest,
        timer: StageTimer | None = None,
    ) -> PlanPart:
        """Plan the restore of ``checkpoint`` (whose manifest is ``manifest``) for the
        partitions the projector owns. A projector owning them all checks the exclusions (a
        mistyped one fails before any replay); an owner of some leaves the names it does not
        know to the requester's check over every part."""
        run, partitions, owned = projector.run, projector.partitions, projector.owned
        whole = owned >= frozenset(range(partitions))
        timer = timer or StageTimer()
        # Everything appended before this request is folded: the episodes begun after the
        # markers (below) are then all known.
        latest = await self.log.latest_offsets(run)
        await projector.wait_until(
            {p: o for p, o in enumerate(latest) if p in owned}, timeout_s=DEFAULT_WAIT_DEADLINE_S
        )
        # ... and every finish folded is in the catalog, so the count of unacknowledged results
        # in the reply (and ``exclude_results``) misses none.
        await flush_episodes(self.catalog, projector, finishes_only=True)

        def mine(episode: str) -> bool:
            return whole or partition_for(episode, partitions) in owned

        if not whole:
            manifest = [e for e in manifest if mine(e.episode)]
        current = await self.catalog.current_attempts(run)
        excluded = {e for e in request.exclude if mine(e)}
        known = {entry.episode for entry in manifest}
        # Episodes begun after the markers are not in the checkpoint; their events belong to the
        # timeline the restore abandons, so they restart (or are excluded) like the others.
        markers = {o.partition: o.marker for o in checkpoint.offsets}
        begun_after = {e: a for e, a in projector.begun_after(markers, known).items() if mine(e)}
        if request.exclude_results:
            held = await self.catalog.result_episodes(run)
            live = {e.episode for e in manifest if e.action != "finished"}
            excluded |= {e for e in held if e in live or e in begun_after}
        if whole:  # before any replay: a mistyped exclusion fails at once
            check_exclusions(checkpoint.checkpoint_id, excluded, known, begun_after)
        else:  # the requester checks the names against every part
            excluded = {e for e in excluded if e in known or e in begun_after}
        timer.stage("manifest")
        continuing = to_continue(manifest, excluded)
        # Episodes untouched since this service captured the checkpoint have their verdict in
        # the projector already; only the others are replayed. Their projections are built when
        # first fetched (``projections``). The policy rule changes projections, so a request
        # with a policy replays everything.
        holder = object()
        policy = request.policy
        pinned = (
            projector.pin_cut_states(checkpoint.checkpoint_id, continuing, holder)
            if not policy.constrains
            else {}
        )
        try:
            replayed = [e for e in continuing if e.episode not in pinned]
            projections: dict[str, EpisodeProjection] = {}
            if replayed:
                restores = {r.restore_id for r in await all_restores(self.catalog, run)}
                new_attempts = {e.episode: current.get(e.episode, e.attempt) + 1 for e in replayed}
                projections = await replay_at_cuts(
                    self.log,
                    run,
                    replayed,
                    replay_start(checkpoint.offsets),
                    restores,
                    quarantined=projector.quarantined,
                    attempts=new_attempts,
                )
            timer.stage("replay")
            plan = plan_restore(
                checkpoint.checkpoint_id,
                manifest,
                current=current,
                begun_after=begun_after,
                exclude=excluded,
                pinned=pinned,
                projections=projections,
                policy=policy,
            )
        except BaseException:
            projector.release_pins(holder)
            raise
        resets = {
            p.entry.episode: RestoreReset(
                p.entry.action,
                p.entry.attempt,
                p.projection,
                pinned[p.entry.episode] if p.from_pin else None,
            )
            for p in plan.episodes
        }
        cuts = planned_cut_dispositions(plan, projections)
        timer.stage("verify")
        return PlanPart(plan, frozenset(begun_after), resets, cuts, holder if pinned else None)

    async def _gather(
        self,
        projector: Projector,
        checkpoint_id: int,
        manifest: Sequence[ManifestEntry],
        request: PlanRequest,
        restore_id: int,
        local: PlanPart,
    ) -> tuple[list[PlannedEpisode], dict[str, int], dict[str, dict[int, int]]]:
        """The whole plan: the local part and the other owners' parts from the catalog (waited
        for until the deadline), in the order one owner of every partition would plan it, with
        the exclusions checked over every part; its cut dispositions; per replica the lease
        generations it planned its partitions at (the commit's fences)."""
        run, owned = projector.run, projector.owned
        needed = set(range(projector.partitions)) - owned
        deadline = time.monotonic() + self.deadline_s
        while True:
            parts = [
                p
                for p in await self.catalog.restore_parts(run, restore_id)
                if p.partition in needed
            ]
            missing = needed - {p.partition for p in parts}
            if not missing:
                break
            if self._owned_now is not None and owned - frozenset(self._owned_now(run)):
                # A partition moved away from this replica: its part would be fenced at the
                # commit. Retry. (Partitions it gained are planned by its projector started
                # afresh, through the poller.)
                raise BackendUnavailable(
                    f"restore {restore_id} of run {run!r}: the run's partitions moved between "
                    "replicas while it was planned; retry",
                    run=run,
                    restore_id=restore_id,
                )
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"restore {restore_id} of run {run!r}: no plan part for partition(s) "
                    f"{sorted(missing)} within {self.deadline_s:g} s (their owners are gone or "
                    "lagging); retry",
                    run=run,
                    restore_id=restore_id,
                    partitions=sorted(missing),
                )
            await asyncio.sleep(_PARTS_POLL_S)
        planned = list(local.plan.episodes)
        after = set(local.after)
        cuts: Counter[str] = Counter(local.cuts)
        fences: dict[str, dict[int, int]] = {
            self.replica_id: {p: g for p, g in projector.generations.items() if p in owned}
        }
        for part in parts:
            episodes, begun_after = _decode(part.body)
            planned.extend(episodes)
            after |= begun_after
            cuts.update(part.body["cuts"])
            if part.generation:
                fences.setdefault(part.replica_id, {})[part.partition] = part.generation
        check_exclusions(checkpoint_id, request.exclude, {e.episode for e in manifest}, after)
        order = {entry.episode: index for index, entry in enumerate(manifest)}
        planned.sort(
            key=lambda p: (
                (1, p.entry.episode, 0)
                if p.entry.episode in after
                else (0, "", order[p.entry.episode])
            )
        )
        return planned, dict(cuts), fences

    async def _abort(self, run: str, restore_id: int, error: BaseException) -> None:
        """Abort a request that failed before its commit (best effort: else at its deadline)."""
        try:
            await self.catalog.abort_restore(run, restore_id, _describe(error))
        except Exception as e:
            logger.warning("run %s: could not abort restore %d: %s", run, restore_id, e)

    # -- other replicas' requests ----------------------------------------------------------

    async def poll(self) -> None:
        """Forever, every ``POLL_S``: plan this replica's partitions of other replicas'
        requests, apply the verdicts of those that ended, abort those past their deadline.

        First, the requests this replica opened before it (re)started are aborted: their
        requester is gone, and its projectors need not wait for their deadline."""
        try:
            await self._abort_own()
            while True:
                try:
                    await self.poll_once()
                except Exception as e:
                    logger.warning("restore poll failed: %s", e)
                await asyncio.sleep(POLL_S if self._shared() else POLL_ALONE_S)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def _shared(self) -> bool:
        """Whether another replica may ask this one for parts or verdicts soon: it owns only
        some of a run's partitions (or none), or plans or awaits a restore."""
        return bool(self._planned) or any(
            len(projector.owned) < projector.partitions or projector.pending_restores
            for projector in self._projectors.values()
        )

    async def _abort_own(self) -> None:
        while True:
            try:
                for request in await self.catalog.planning_restores():
                    if request.requested_by == self.replica_id:
                        await self.catalog.abort_restore(
                            request.run, request.restore_id, "its requester restarted"
                        )
                return
            except Exception as e:
                logger.warning("could not abort this replica's earlier restores: %s", e)
                await asyncio.sleep(POLL_S)

    async def poll_once(self) -> None:
        """One round of ``poll`` (one query while nothing happens)."""
        requests = await self.catalog.planning_restores()
        if any(r.deadline_at < time.time() for r in requests):
            await self.catalog.abort_expired_restores()
            requests = await self.catalog.planning_restores()
        planning = {(r.run, r.restore_id) for r in requests}
        for request in requests:
            key = (request.run, request.restore_id)
            projector = self._projectors.get(request.run)
            # This replica's own requests are planned in-process, unless the run's projector was
            # started afresh since (an owner change): then its partitions are planned here.
            own = request.requested_by == self.replica_id
            if (
                projector is None
                or not projector.owned
                or self._planned.get(key) is projector
                or (own and self._requesting.get(key, projector) is projector)
            ):
                continue
            self._planned[key] = projector
            task = asyncio.create_task(self._plan_remote(projector, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for run, projector in list(self._projectors.items()):
            for restore_id in projector.pending_restores:
                if (run, restore_id) in planning:
                    continue
                try:
                    status = (await self.catalog.get_restore_request(run, restore_id)).status
                except UnknownRestore:  # the run was deleted
                    status = "aborted"
                if status != "planning":
                    projector.end_restore(restore_id, status == "committed")
        for key in [key for key in self._planned if key not in planning]:
            del self._planned[key]

    async def _plan_remote(self, projector: Projector, request: RestorePlanning) -> None:
        """Plan and write this replica's part of another replica's request; the verdict comes
        from ``poll_once``. A part that cannot be written leaves the request to abort."""
        run, restore_id = request.run, request.restore_id
        try:
            checkpoint = await self.catalog.get_checkpoint(run, request.checkpoint_id)
            manifest = await self.catalog.load_manifest(run, request.checkpoint_id)
            with collector_paused():
                part = await self.plan_part(
                    projector, checkpoint, manifest, PlanRequest.from_json(request.request)
                )
            projector.begin_restore(restore_id, part.resets, part.pins)
            # Parts a previous projector of this replica wrote (at generations still valid, or
            # the commit refuses them) stand; this one's plan of them is the same.
            written = {p.partition for p in await self.catalog.restore_parts(run, restore_id)}
            bodies = part.bodies(projector.partitions, projector.owned)
            bodies = {p: b for p, b in bodies.items() if p not in written}
            if bodies:
                await self.catalog.write_restore_parts(
                    run, restore_id, self.replica_id, projector.generations, bodies
                )
        except Exception as e:
            logger.warning(
                "run %s: could not plan this replica's part of restore %d: %s",
                run,
                restore_id,
                _describe(e),
            )

    async def committed_checkpoint(self, run: str, checkpoint_id: int | str) -> Checkpoint:
        """The checkpoint a restore or a projection read names (an id or ``"latest"``), which
        must be committed."""
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

    async def _write_attempts(
        self,
        run: str,
        partitions: int,
        restore_id: int,
        checkpoint_id: int,
        plan: Sequence[PlannedEpisode],
        controller_epoch: int,
    ) -> None:
        """One ``attempt.started`` per planned episode (``attempt_started_record``)."""
        now = time.time()
        records = [
            Record(
                partition_for(planned.entry.episode, partitions),
                planned.entry.episode.encode(),
                attempt_started_record(
                    planned.entry.episode,
                    planned.entry.attempt,
                    restore_id=restore_id,
                    checkpoint_id=checkpoint_id,
                    previous_attempt=planned.entry.previous_attempt,
                    cut=planned.cut,
                    controller_epoch=controller_epoch,
                    ts=now,
                ),
            )
            for planned in plan
        ]
        for start in range(0, len(records), 4096):
            await self.log.append_records(run, records[start : start + 4096])

    # -- serving projections ---------------------------------------------------------------

    async def restore_projections(self, run: str, restore_id: int) -> dict[str, EpisodeProjection]:
        """Every continued episode's projection of a committed restore, replayed from the log
        (deterministic from the log and the catalog; the routes serve ``projection_lines``)."""
        replayed = await self._replay_restore(run, restore_id)
        return {projection.episode: projection async for projection in replayed}

    async def projection_lines(self, run: str, restore_id: int) -> RestoreLines:
        """A committed restore's projection lines: from the cache (perhaps still being built),
        else built from a replay of the log (``replay_stream``: each line as soon as its
        episode is folded) and cached. Unknown or gone restores raise here, before anything is
        streamed."""
        cached = self.cache.get(run, restore_id)
        if cached is not None:
            return cached
        lines = self._build(run, restore_id, await self._replay_restore(run, restore_id))
        self.cache.put(run, restore_id, lines)
        return lines

    async def _replay_restore(self, run: str, restore_id: int) -> AsyncIterator[EpisodeProjection]:
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
        restores = {
            r.restore_id for r in await all_restores(self.catalog, run) if r.restore_id < restore_id
        }
        projector = self._projectors.get(run)
        stream = replay_stream(
            self.log,
            run,
            wanted,
            replay_start(checkpoint.offsets),
            restores,
            quarantined=projector.quarantined if projector is not None else frozenset(),
            attempts={e.episode: e.attempt for e in entries},
        )
        try:
            request = (await self.catalog.get_restore_request(run, restore_id)).request
        except UnknownRestore:  # committed before restores kept their request
            return stream
        policy = PlanRequest.from_json(request).policy
        return stream if not policy.constrains else _with_policy(stream, policy)

    def _build_planned(
        self,
        run: str,
        restore_id: int,
        projector: Projector,
        checkpoint: Checkpoint,
        manifest: Sequence[ManifestEntry],
        part: PlanPart,
    ) -> RestoreLines:
        """The lines of a restore planned in-process, built while it commits: its continued
        projections from the plan when it replayed them, else from a replay of their records
        (what ``_replay_restore`` reads once the restore is committed)."""
        attempts = {
            p.entry.episode: p.entry.attempt
            for p in part.plan.episodes
            if p.entry.action == "continue"
        }
        if part.pins is None:
            kept = part.plan.projections
            return self._build(run, restore_id, _each(kept[e] for e in attempts if e in kept))

        async def replayed() -> AsyncIterator[EpisodeProjection]:
            restores = {r.restore_id for r in await all_restores(self.catalog, run)}
            stream = replay_stream(
                self.log,
                run,
                [e for e in manifest if e.episode in attempts],
                replay_start(checkpoint.offsets),
                restores,
                quarantined=projector.quarantined,
                attempts=attempts,
            )
            async for projection in stream:
                yield projection

        return self._build(run, restore_id, replayed())

    def _build(
        self, run: str, restore_id: int, projections: AsyncIterator[EpisodeProjection]
    ) -> RestoreLines:
        """Encode ``projections`` into new ``RestoreLines`` in a task (dropped from the cache
        if it fails: the next fetch builds them again)."""
        lines = RestoreLines()

        async def fill() -> None:
            try:
                async for projection in projections:
                    lines.add(ProjectionLine.of(projection))
            except BaseException as e:
                lines.finish(e)
                self.cache.drop(run, restore_id, lines)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
            lines.finish()
            self.cache.trim((run, restore_id))

        # The task is held here, not by the lines: a cycle through the task's frame would keep a
        # superseded restore's lines (all of them) until a collection, which ``gc.freeze`` after
        # a restore may put off for good (measured: +160 MB peak over two S1 restores).
        task = asyncio.create_task(fill())
        self._builds.add(task)
        task.add_done_callback(self._builds.discard)
        return lines

    async def checkpoint_projection(
        self, run: str, checkpoint_id: int, episode: str
    ) -> EpisodeProjection:
        """One episode's projection at a committed checkpoint's cut (no restore needed)."""
        checkpoint = await self.committed_checkpoint(run, checkpoint_id)
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
        restores = {r.restore_id for r in await all_restores(self.catalog, run)}
        projections = await self._replay(run, checkpoint, [entry], restores)
        projection = projections.get(episode)
        if projection is None:
            raise UnknownEpisode(
                f"episode {episode!r} has no events before its cut", episode=episode
            )
        return projection

    async def _replay(
        self,
        run: str,
        checkpoint: Checkpoint,
        entries: Sequence[ManifestEntry],
        restores: set[int],
        attempts: Mapping[str, int] | None = None,
    ) -> dict[str, EpisodeProjection]:
        projector = self._projectors.get(run)
        return await replay_at_cuts(
            self.log,
            run,
            entries,
            replay_start(checkpoint.offsets),
            restores,
            quarantined=projector.quarantined if projector is not None else frozenset(),
            attempts=attempts,
        )
