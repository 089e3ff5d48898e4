"""The projections a restore serves (docs/design.md §10 "A restore"): a committed restore's
continued projections as NDJSON lines (``RestoreLines``), built while the restore commits or
from a replay of the log when first asked for, and cached within a byte budget
(``ProjectionCache``); and the projection reads: ``projection_lines``,
``restore_projections``, ``checkpoint_projection``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence

from rolloutlog import _malloc
from rolloutlog._gc import collector_paused
from rolloutlog.catalog import Catalog, Checkpoint, ManifestEntry
from rolloutlog.core import (
    EpisodeProjection,
    ProjectionLine,
    RestorePolicy,
    apply_policy,
    composable,
    replay_start,
)
from rolloutlog.errors import InvalidRequest, UnknownCheckpoint, UnknownEpisode, UnknownRestore
from rolloutlog.log import Log
from rolloutlog.projections._part_planner import PlanPart, PlanRequest
from rolloutlog.projections._prepared import RestorePreparer
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._replay import (
    Composable,
    compose_stream,
    replay_at_cuts,
    replay_stream,
)
from rolloutlog.projections._start_plan import all_restores

__all__ = ["ProjectionCache", "ProjectionServer", "RestoreLines", "committed_checkpoint"]

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
        self.size_bytes += line.held_bytes
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


async def committed_checkpoint(catalog: Catalog, run: str, checkpoint_id: int | str) -> Checkpoint:
    """The checkpoint a restore or a projection read names (an id or ``"latest"``), which
    must be committed."""
    if checkpoint_id == "latest":
        checkpoint = await catalog.latest_checkpoint(run)
    elif isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        checkpoint = await catalog.get_checkpoint(run, checkpoint_id)
    else:
        raise InvalidRequest('checkpoint_id must be an integer or "latest"', field="checkpoint_id")
    if checkpoint.status != "committed":
        raise UnknownCheckpoint(
            f"checkpoint {checkpoint.checkpoint_id} of run {run!r} is {checkpoint.status}: "
            "only a committed checkpoint can be restored",
            run=run,
            checkpoint_id=checkpoint.checkpoint_id,
            status=checkpoint.status,
        )
    return checkpoint


class ProjectionServer:
    """Serves the projections of a service's restores and checkpoints, and builds a restore's
    lines ahead of its fetch (``build_ahead``)."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        projectors: Mapping[str, Projector],
        cache: ProjectionCache,
        preparer: RestorePreparer | None = None,
    ) -> None:
        self.log = log
        self.catalog = catalog
        self._projectors = projectors
        self.cache = cache
        self._preparer = preparer
        #: Projection lines being built (``_build``).
        self._builds: set[asyncio.Task[None]] = set()

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
            continuing_attempts={e.episode: e.attempt for e in entries},
        )
        try:
            request = (await self.catalog.get_restore_request(run, restore_id)).request
        except UnknownRestore:  # committed before restores kept their request
            return stream
        policy = PlanRequest.from_json(request).policy
        return stream if not policy.constrains else _with_policy(stream, policy)

    def build_ahead(
        self,
        run: str,
        restore_id: int,
        projector: Projector,
        checkpoint: Checkpoint,
        manifest: Sequence[ManifestEntry],
        part: PlanPart,
        settle: Callable[[], None],
    ) -> None:
        """Cache the lines of a restore just committed, whose plan ``part`` is whole (its
        planner owns every partition), built now rather than when the fetch that follows the
        reply asks. ``settle`` gives the projector the restore's resets: the build calls it once
        the lines that need no tracker are handed over, before it reads a tracker (and when it
        ends, whatever ended it). (Started before the commit, the build held the event loop
        from the commit: the plan then took as long as the replay.)"""
        _release_freed()
        # Taken now: a checkpoint that begins once the reply is out ends the prepare.
        prepared = (
            {} if self._preparer is None else self._preparer.take(run, checkpoint.checkpoint_id)
        )
        projections = self._planned(
            run, restore_id, projector, checkpoint, manifest, part, prepared, settle
        )
        self.cache.put(run, restore_id, self._build(run, restore_id, projections, settle))

    async def _planned(
        self,
        run: str,
        restore_id: int,
        projector: Projector,
        checkpoint: Checkpoint,
        manifest: Sequence[ManifestEntry],
        part: PlanPart,
        prepared: dict[str, ProjectionLine],
        settle: Callable[[], None],
    ) -> AsyncIterator[EpisodeProjection | ProjectionLine]:
        """A plan's continued projections: the plan's own when it replayed them; prepared when
        the checkpoint committed (``RestorePreparer``) for the episodes its pins continue from
        their state at the cut, given the new attempts. Then, the restore's resets applied a
        slice at a time (a fetch streams those lines meanwhile) and ``settle`` called, the
        others: composed from the records their trackers'
        positions name when its pins held them, else from a replay of their records (what
        ``_replay_restore`` reads once the restore is committed)."""
        attempts = {
            p.entry.episode: p.entry.attempt
            for p in part.plan.episodes
            if p.entry.action == "continue"
        }
        kept = part.plan.projections
        cuts = {e.episode: e for e in manifest if e.episode in attempts}
        # Neither the plan's own projections nor the prepared lines read a tracker: they go
        # out before the resets (the pins kept each prepared line's state, the cut's).
        later: list[ManifestEntry] = []
        replay: list[ManifestEntry] = []
        try:
            for episode in attempts:
                if episode in kept:
                    yield kept[episode]
            if part.pins is None:
                return
            for index, (episode, attempt) in enumerate(attempts.items(), 1):
                entry = cuts.get(episode)
                if episode in kept or entry is None:
                    continue
                reset = part.resets.get(episode)
                line = prepared.pop(episode, None)
                if reset is None or reset.pinned is None:
                    replay.append(entry)
                elif line is None:
                    later.append(entry)
                else:
                    try:
                        # The prepared line let go as its copy for the new attempt is made
                        # (both held at once would cost a second copy of every line).
                        line = line.as_attempt(attempt, was=entry.attempt)
                    except ValueError:
                        replay.append(entry)
                        continue
                    yield line
                    del line
                    if index % _ENCODE_SLICE == 0:
                        await asyncio.sleep(0)
            more = projector.reset_some(restore_id, _ENCODE_SLICE)
            while more:
                await asyncio.sleep(0)  # the fetch's turn
                more = projector.reset_some(restore_id, _ENCODE_SLICE)
        finally:
            prepared.clear()
            settle()
        # The trackers' states are the projections now (reset to the new attempts): noted here,
        # before the fold goes on (the new attempts' records), each with its version; composed
        # below if the tracker has not moved on by then, else replayed.
        wanted: list[Composable] = []
        trackers = projector.trackers
        with collector_paused():
            for entry in later:
                tracker = trackers.get(entry.episode)
                if (
                    tracker is not None
                    and tracker.attempt == attempts[entry.episode]
                    and composable(tracker)
                ):
                    wanted.append(Composable.of(entry, tracker))
                else:
                    replay.append(entry)
        later.clear()
        failed: list[str] = []
        async for projection in compose_stream(self.log, run, wanted, trackers, failed):
            yield projection
        replay.extend(cuts[e] for e in failed)
        if not replay:
            return
        restores = {r.restore_id for r in await all_restores(self.catalog, run)}
        stream = replay_stream(
            self.log,
            run,
            replay,
            replay_start(checkpoint.offsets),
            restores,
            quarantined=projector.quarantined,
            continuing_attempts=attempts,
        )
        async for projection in stream:
            yield projection

    def _build(
        self,
        run: str,
        restore_id: int,
        projections: AsyncIterator[EpisodeProjection | ProjectionLine],
        ended: Callable[[], None] | None = None,
    ) -> RestoreLines:
        """Encode ``projections`` (or take their lines, when prepared) into new
        ``RestoreLines`` in a task (dropped from the cache if it fails: the next fetch builds
        them again); ``ended`` is called when the task ends, however it ends."""
        lines = RestoreLines()

        async def fill() -> None:
            try:
                async for projection in projections:
                    lines.add(
                        projection
                        if isinstance(projection, ProjectionLine)
                        else ProjectionLine.of(projection)
                    )
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
        if ended is not None:
            task.add_done_callback(lambda _: ended())
        return lines

    async def checkpoint_projection(
        self, run: str, checkpoint_id: int, episode: str
    ) -> EpisodeProjection:
        """One episode's projection at a committed checkpoint's cut (no restore needed)."""
        checkpoint = await committed_checkpoint(self.catalog, run, checkpoint_id)
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
            continuing_attempts=attempts,
        )
