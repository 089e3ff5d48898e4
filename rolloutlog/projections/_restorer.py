"""Restores (docs/design.md §6, §10 "A restore"): the runner around the pure planner
(``_planner.py``). It fences the controller, reads the checkpoint and its manifest, waits for the
projector, gathers each ``continue`` episode's state at its cut (pinned trackers, else a replay of
the log), asks the planner, reserves the restore's id, writes the ``attempt.started`` records and
commits the plan in one catalog transaction. A failure anywhere commits nothing: the projector
discards the restore and the old attempts stay current."""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rolloutlog.catalog import Catalog, Checkpoint, ManifestEntry, Restore, RestoreEntry
from rolloutlog.errors import (
    InvalidRequest,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRestore,
)
from rolloutlog.log import Log, Record, attempt_started_record, partition_for
from rolloutlog.projections._checkpointer import DEFAULT_WAIT_DEADLINE_S
from rolloutlog.projections._cuts import planned_cut_dispositions
from rolloutlog.projections._feeders import flush_episodes
from rolloutlog.projections._model import EpisodeProjection
from rolloutlog.projections._planner import (
    PlannedEpisode,
    RestorePolicy,
    check_exclusions,
    plan_restore,
    replay_start,
    to_continue,
)
from rolloutlog.projections._projector import Projector, RestoreReset
from rolloutlog.projections._replay import replay_at_cuts, replay_stream
from rolloutlog.projections._start_plan import all_restores
from rolloutlog.projections._timing import StageTimer

__all__ = ["ProjectionCache", "RestoreResult", "Restorer", "projection_bytes"]


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore: Restore
    entries: tuple[RestoreEntry, ...]
    timings_ms: Mapping[str, float]
    #: Generation cuts dropped or restarted, by disposition (``planned_cut_dispositions``).
    cuts: Mapping[str, int] = field(default_factory=dict)


#: What a cached projection's objects cost besides its payloads (the projection, its maps and
#: tuples): S1's projections measure 8.0 KB each with ``tracemalloc``, ``projection_bytes`` says
#: 7.9 KB.
_PROJECTION_OVERHEAD = 2600


def projection_bytes(projection: EpisodeProjection) -> int:
    """The memory a projection holds: its payloads (task, states), its ledger's token ids (raw
    JSON), its generation cut's ids (8 bytes each as a tuple of small ints) and its objects."""
    size = projection.payload_bytes + _PROJECTION_OVERHEAD
    for row in projection.ledger:
        size += len(row.token_ids_json) + 320
    if projection.generation_cut is not None:
        size += 8 * len(projection.generation_cut.token_ids)
    return size


class ProjectionCache:
    """Committed restores' continued projections within a byte budget (``projection_bytes``).

    A run's newest committed restore supersedes its older ones (their attempts are fenced): they
    are dropped when it is cached (and when a restore of the run begins, so that a restore's
    replay never holds two generations), and rebuilt from the log if asked for again. Over the
    budget, the other runs' restores go first, oldest first; the newest restore just put is
    always kept."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._entries: dict[tuple[str, int], tuple[dict[str, EpisodeProjection], int]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, run: str, restore_id: int) -> dict[str, EpisodeProjection] | None:
        found = self._entries.get((run, restore_id))
        return None if found is None else found[0]

    @property
    def size_bytes(self) -> int:
        return sum(size for _, size in self._entries.values())

    def put(self, run: str, restore_id: int, projections: dict[str, EpisodeProjection]) -> None:
        newest = max((rid for r, rid in self._entries if r == run), default=-1)
        if restore_id < newest:
            return  # an older restore rebuilt on demand: served once, not kept
        self.forget_run(run)
        size = sum(projection_bytes(p) for p in projections.values())
        self._entries[(run, restore_id)] = (projections, size)
        total = self.size_bytes
        for key in sorted(self._entries, key=lambda k: k[1]):
            if total <= self._budget:
                break
            if key != (run, restore_id):
                total -= self._entries.pop(key)[1]

    def forget_run(self, run: str) -> None:
        for key in [key for key in self._entries if key[0] == run]:
            del self._entries[key]


async def _each(projections: Iterable[EpisodeProjection]) -> AsyncIterator[EpisodeProjection]:
    for projection in projections:
        yield projection


class Restorer:
    """Runs a service's restores, and serves the projections of restores and checkpoints."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        projectors: Mapping[str, Projector],
        cache: ProjectionCache,
    ) -> None:
        self.log = log
        self.catalog = catalog
        self._projectors = projectors
        self.cache = cache

    async def restore(
        self,
        projector: Projector,
        controller_epoch: int,
        checkpoint_id: int | str,
        exclude: Iterable[str],
        policy: RestorePolicy,
        exclude_results: bool = False,
    ) -> RestoreResult:
        """Plan and commit a restore of the projector's run (the caller holds the run's lock).

        ``exclude_results``: also exclude every episode the plan would continue or restart whose
        finished result the catalog holds (the trainer reads it from the results route)."""
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
        # Everything appended before this request is folded: the episodes begun after the
        # markers (below) are then all known.
        await projector.wait_until(
            dict(enumerate(await self.log.latest_offsets(run))), timeout_s=DEFAULT_WAIT_DEADLINE_S
        )
        # ... and every finish folded is in the catalog, so the count of unacknowledged results
        # in the reply (and ``exclude_results``) misses none.
        await flush_episodes(self.catalog, projector, finishes_only=True)
        manifest = await self.catalog.load_manifest(run, checkpoint.checkpoint_id)
        current = await self.catalog.current_attempts(run)
        excluded = set(exclude)
        known = {entry.episode for entry in manifest}
        # Episodes begun after the markers are not in the checkpoint; their events belong to the
        # timeline the restore abandons, so they restart (or are excluded) like the others.
        markers = {o.partition: o.marker for o in checkpoint.offsets}
        begun_after = projector.begun_after(markers, known)
        if exclude_results:
            held = await self.catalog.result_episodes(run)
            live = {e.episode for e in manifest if e.action != "finished"}
            excluded |= {e for e in held if e in live or e in begun_after}
        # Before any replay: a mistyped exclusion fails at once.
        check_exclusions(checkpoint.checkpoint_id, excluded, known, begun_after)
        timer.stage("manifest")
        continuing = to_continue(manifest, excluded)
        # Episodes untouched since this service captured the checkpoint have their verdict in
        # the projector already; only the others are replayed. Their projections are built when
        # first fetched (``projections``). The policy rule changes projections, so a request
        # with a policy replays everything.
        pinned = (
            projector.pin_cut_states(checkpoint.checkpoint_id, continuing)
            if not policy.constrains
            else {}
        )
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
        resets = {
            p.entry.episode: RestoreReset(
                p.entry.action,
                p.entry.attempt,
                p.projection,
                pinned[p.entry.episode] if p.from_pin else None,
            )
            for p in plan.episodes
        }
        entries = plan.entries
        cuts = planned_cut_dispositions(plan, projections)
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
                plan.episodes,
                controller_epoch,
            )
            timer.stage("attempts")
            restore = await self.catalog.commit_restore(
                run,
                controller_epoch,
                checkpoint.checkpoint_id,
                entries,
                timings_ms=timer.total(),
                restore_id=restore_id,
            )
            committed = True
            timer.stage("commit")
        finally:
            projector.end_restore(restore_id, committed)
        if not pinned:  # else the projections are built when first fetched
            self.cache.put(run, restore_id, plan.projections)
        # What stays (cached projections, the trackers' new states): keep the collector from
        # walking it again and again.
        gc.freeze()
        return RestoreResult(restore, entries, timer.total(), cuts)

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
        """Every continued episode's projection of a committed restore (recomputed after a
        service restart: deterministic from the log and the catalog)."""
        cached = self.cache.get(run, restore_id)
        if cached is not None:
            return cached
        stream = await self.projection_stream(run, restore_id)
        return {projection.episode: projection async for projection in stream}

    async def projection_stream(
        self, run: str, restore_id: int
    ) -> AsyncIterator[EpisodeProjection]:
        """``restore_projections`` one at a time: from the cache, else as the replay folds each
        (``replay_stream``), cached once all were folded. Unknown or gone restores raise here,
        before anything is streamed."""
        cached = self.cache.get(run, restore_id)
        if cached is not None:
            return _each(cached.values())
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
        attempts = {e.episode: e.attempt for e in entries}
        projector = self._projectors.get(run)
        stream = replay_stream(
            self.log,
            run,
            wanted,
            replay_start(checkpoint.offsets),
            restores,
            quarantined=projector.quarantined if projector is not None else frozenset(),
            attempts=attempts,
        )
        return self._caching(run, restore_id, stream)

    async def _caching(
        self, run: str, restore_id: int, stream: AsyncIterator[EpisodeProjection]
    ) -> AsyncIterator[EpisodeProjection]:
        result: dict[str, EpisodeProjection] = {}
        async for projection in stream:
            result[projection.episode] = projection
            yield projection
        self.cache.put(run, restore_id, result)

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
