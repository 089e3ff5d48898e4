"""A restore planned per partition owner (docs/design.md §10 "A restore"): each owner plans
the part of the restore its partitions hold (``plan_part``: pinned trackers, else a replay of
the log, then the pure planner); the requester plans its own in-process and gathers the others'
(``gather``); every replica's poller plans its partitions' parts of the requests other
replicas opened, as ``restore_parts`` rows, and applies the verdicts of those that ended
(``poll``). A requester that owns every partition has nothing to gather: its part is the
plan."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import (
    Catalog,
    Checkpoint,
    ManifestEntry,
    RestoreEntry,
    RestorePart,
    RestorePlanning,
)
from rolloutlog.core import (
    EpisodeProjection,
    PlannedEpisode,
    RestorePlan,
    RestorePolicy,
    check_exclusions,
    plan_restore,
    planned_cut_dispositions,
    replay_start,
    to_continue,
)
from rolloutlog.errors import BackendUnavailable, UnknownRestore
from rolloutlog.log import Log, partition_for
from rolloutlog.projections._checkpointer import DEFAULT_WAIT_DEADLINE_S
from rolloutlog.projections._feeders import flush_episodes
from rolloutlog.projections._projector import Projector, _describe
from rolloutlog.projections._replay import replay_at_cuts
from rolloutlog.projections._restore_resets import RestoreReset
from rolloutlog.projections._start_plan import all_restores
from rolloutlog.projections._timing import StageTimer

logger = logging.getLogger(__name__)

__all__ = ["POLL_ALONE_S", "POLL_S", "PartPlanner", "PlanPart", "PlanRequest", "Plan"]

#: How often a replica looks for other replicas' requests and for the verdicts it waits for,
#: while it shares a run's partitions with other replicas or waits for a verdict; alone, every
#: ``POLL_ALONE_S`` (a lone embedded service spent a tenth of a core polling at ``POLL_S``).
POLL_S = 0.05
POLL_ALONE_S = 1.0
#: How often a requester looks for the other owners' parts.
_PARTS_POLL_S = 0.025


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


#: A restore's whole plan: its planned episodes in order, its cut dispositions, and per replica
#: the lease generations it planned its partitions at (the commit's fences).
Plan = tuple[Sequence[PlannedEpisode], dict[str, int], dict[str, dict[int, int]]]


async def plan_inputs(
    catalog: Catalog,
    run: str,
    checkpoint_id: int,
    captured: list[ManifestEntry] | None = None,
) -> tuple[list[ManifestEntry], dict[str, int]]:
    """The manifest of a committed checkpoint and the run's current attempts, read at once
    (neither waits for the other: attempts change only when a restore commits, and a plan
    made from attempts a later restore changed is refused as stale by its commit). A manifest
    ``captured`` (the projector's own, ``committed_manifest``: what the catalog holds) is not
    read again."""
    if captured is not None:
        return captured, await catalog.current_attempts(run)
    return await asyncio.gather(
        catalog.load_manifest(run, checkpoint_id), catalog.current_attempts(run)
    )


class PartPlanner:
    """Plans a service's parts of restores: its own requests' in-process, other replicas'
    requests' through ``poll``."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        projectors: Mapping[str, Projector],
        *,
        replica_id: str = "local",
        owned_now: Callable[[str], Collection[int]] | None = None,
    ) -> None:
        self.log = log
        self.catalog = catalog
        self.projectors = projectors
        self.replica_id = replica_id
        #: This replica's requests being run, with the projector that plans them in-process
        #: (the runner's: ``Restorer``).
        self.requesting: dict[tuple[str, int], Projector] = {}
        #: The partitions of a run this replica's leases hold now (its projector, relaunched
        #: only once the restore releases the run, may still fold the ones it held before).
        self._owned_now = owned_now
        #: Other replicas' requests this one planned (or is planning), with the projector.
        self._planned: dict[tuple[str, int], Projector] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def plan_part(
        self,
        projector: Projector,
        checkpoint: Checkpoint,
        manifest: Sequence[ManifestEntry],
        current: Mapping[str, int],
        request: PlanRequest,
        timer: StageTimer | None = None,
    ) -> PlanPart:
        """Plan the restore of ``checkpoint`` (whose manifest is ``manifest``; the run's
        current attempts are ``current``, both from ``plan_inputs``) for the partitions the
        projector owns. A projector owning them all checks the exclusions (a
        mistyped one fails before any replay); an owner of some leaves the names it does not
        know to the requester's check over every part."""
        run, partitions, owned = projector.run, projector.partitions, projector.owned
        whole = projector.owns_every_partition
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
        # first fetched, or ahead of it (``ProjectionServer``). The policy rule changes
        # projections, so a request with a policy replays everything.
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
                    continuing_attempts=new_attempts,
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

    async def gather(
        self,
        projector: Projector,
        checkpoint_id: int,
        manifest: Sequence[ManifestEntry],
        request: PlanRequest,
        restore_id: int,
        local: PlanPart,
        *,
        lock: asyncio.Lock,
        deadline_s: float,
        timer: StageTimer,
    ) -> Plan:
        """The whole plan from the local part (planned by ``projector``) and the other owners'
        parts (``Plan``). A projector that owns every partition has no others to wait for: its
        part is the plan. Otherwise their parts are read from the catalog as they come (until
        ``deadline_s``; the ``parts`` stage), with the run's ``lock`` let go meanwhile (an owner
        change may start the run's projector afresh: the poller then plans the new one's
        partitions), and merged in the order one owner of every partition would plan them,
        with the exclusions checked over every part."""
        owned = projector.owned
        fences = {self.replica_id: {p: g for p, g in projector.generations.items() if p in owned}}
        others = set(range(projector.partitions)) - owned
        if not others:
            return local.plan.episodes, dict(local.cuts), fences
        lock.release()
        try:
            parts = await self._parts(projector, restore_id, others, deadline_s)
        finally:
            await lock.acquire()
        timer.stage("parts")
        planned = list(local.plan.episodes)
        after = set(local.after)
        cuts: Counter[str] = Counter(local.cuts)
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

    async def _parts(
        self, projector: Projector, restore_id: int, needed: set[int], deadline_s: float
    ) -> list[RestorePart]:
        """The other owners' parts of the ``needed`` partitions, waited for until the
        deadline."""
        run, owned = projector.run, projector.owned
        deadline = time.monotonic() + deadline_s
        while True:
            parts = [
                p
                for p in await self.catalog.restore_parts(run, restore_id)
                if p.partition in needed
            ]
            missing = needed - {p.partition for p in parts}
            if not missing:
                return parts
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
                    f"{sorted(missing)} within {deadline_s:g} s (their owners are gone or "
                    "lagging); retry",
                    run=run,
                    restore_id=restore_id,
                    partitions=sorted(missing),
                )
            await asyncio.sleep(_PARTS_POLL_S)

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
            for projector in self.projectors.values()
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
            projector = self.projectors.get(request.run)
            # This replica's own requests are planned in-process, unless the run's projector was
            # started afresh since (an owner change): then its partitions are planned here.
            own = request.requested_by == self.replica_id
            if (
                projector is None
                or not projector.owned
                or self._planned.get(key) is projector
                or (own and self.requesting.get(key, projector) is projector)
            ):
                continue
            self._planned[key] = projector
            task = asyncio.create_task(self._plan_remote(projector, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for run, projector in list(self.projectors.items()):
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
            manifest, current = await plan_inputs(self.catalog, run, request.checkpoint_id)
            with collector_paused():
                part = await self.plan_part(
                    projector, checkpoint, manifest, current, PlanRequest.from_json(request.request)
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
