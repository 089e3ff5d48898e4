"""Replaying a checkpoint: every named episode's records folded at its cut, read from the log
(partitions in parallel). The restore runner and the projection doors use it.

``replay_stream`` hands each projection out as soon as the read has passed its cut, so that a
restore's first fetch streams projections while the rest of the log is still being read (and the
client decodes them meanwhile), and each episode's records are dropped once folded rather than
all held until the end of the read."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import NamedTuple, cast

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import (
    EpisodeFold,
    EpisodeProjection,
    compose_projection,
    projection_positions,
)
from rolloutlog.log import Log, peek_record, record_episode, record_payload_start
from rolloutlog.projections._fold import project_raw

logger = logging.getLogger(__name__)

__all__ = ["Composable", "compose_stream", "replay_at_cuts", "replay_stream"]


async def replay_at_cuts(
    log: Log,
    run: str,
    entries: Sequence[ManifestEntry],
    replay_from: Mapping[int, int],
    committed_restores: set[int],
    *,
    quarantined: Collection[tuple[int, int]] = frozenset(),
    continuing_attempts: Mapping[str, int] | None = None,
) -> dict[str, EpisodeProjection]:
    """Fold every named episode at its cut; partitions are read in parallel from
    ``replay_from`` (``replay_start``). ``quarantined`` positions are skipped (the projector
    skipped them); ``continuing_attempts`` labels each projection with
    the attempt that continues it. An episode with no records before its cut, or one the fold
    cannot apply, has no projection."""
    stream = replay_stream(
        log,
        run,
        entries,
        replay_from,
        committed_restores,
        quarantined=quarantined,
        continuing_attempts=continuing_attempts,
    )
    return {projection.episode: projection async for projection in stream}


async def replay_stream(
    log: Log,
    run: str,
    entries: Sequence[ManifestEntry],
    replay_from: Mapping[int, int],
    committed_restores: set[int],
    *,
    quarantined: Collection[tuple[int, int]] = frozenset(),
    continuing_attempts: Mapping[str, int] | None = None,
) -> AsyncIterator[EpisodeProjection]:
    """``replay_at_cuts``, one projection at a time as each is folded (in no fixed order)."""
    continuing = continuing_attempts
    by_partition: dict[int, dict[str, int]] = defaultdict(dict)
    attempts_at_cut: dict[str, int] = {}
    for entry in entries:
        by_partition[entry.cut_partition][entry.episode] = entry.cut_offset
        attempts_at_cut[entry.episode] = entry.attempt

    def fold(
        episodes: Sequence[str],
        cuts: Mapping[str, int],
        records: dict[str, list[tuple[int, bytes]]],
    ) -> list[EpisodeProjection]:
        out: list[EpisodeProjection] = []
        with collector_paused():
            for episode in episodes:
                mine = records.pop(episode)
                if not mine:
                    continue
                try:
                    out.append(
                        project_raw(
                            episode,
                            mine,
                            cuts[episode],
                            committed_restores,
                            continuing_attempt=None
                            if continuing is None
                            else continuing.get(episode),
                            attempt_at_cut=attempts_at_cut[episode],
                        )
                    )
                except Exception:  # a record the fold cannot apply: it has no projection
                    logger.exception("run %s: could not fold episode %s", run, episode)
        return out

    def collect(partition: int, cuts: Mapping[str, int]) -> _Collect:
        records: dict[str, list[tuple[int, bytes]]] = {episode: [] for episode in cuts}

        def take(page: Sequence[tuple[int, bytes | memoryview]]) -> None:
            for item in page:
                if quarantined and (partition, item[0]) in quarantined:
                    continue  # the projector skipped it: so does the fold
                try:
                    episode = record_episode(item[1])
                except ValueError:  # not an envelope (the projector quarantines it)
                    continue
                wanted = records.get(episode)  # type: ignore[arg-type]
                if wanted is not None:
                    wanted.append(cast("tuple[int, bytes]", item))  # read with in_place=False

        return take, lambda episodes: fold(episodes, cuts, records)

    reads = {
        partition: _PartitionRead(replay_from.get(partition, 0), cuts, collect(partition, cuts))
        for partition, cuts in by_partition.items()
    }
    async for projection in _read_partitions(log, run, reads, in_place=False):
        yield projection


async def compose_stream(
    log: Log,
    run: str,
    wanted: Sequence[Composable],
    trackers: Mapping[str, EpisodeFold] | None,
    failed: list[str],
) -> AsyncIterator[EpisodeProjection]:
    """The projections of ``wanted`` composed from the records at their positions as the reads
    pass them (partitions in parallel, in no fixed order): nothing is folded again
    (``rolloutlog.core._compose``). Each projection is composed from its state once its records
    are read, so that nothing is copied ahead; an episode whose state is no longer ``trackers``'
    (another tracker, or the same one moved on from its version; None: states that are nobody's
    and do not change) or whose records are not what it says is added to ``failed`` (for a
    replay) instead."""
    by_partition: dict[int, dict[str, Composable]] = defaultdict(dict)
    for item in wanted:
        by_partition[item.partition][item.episode] = item

    def collect(mine: Mapping[str, Composable], first: int, end: int) -> _Collect:
        # Which offsets of the read some projection reads (a byte each: a set of them cost
        # ~10 MB for S1), and those records by offset until their episode is composed.
        wanted = bytearray(end - first)
        for item in mine.values():
            for offset in item.positions:
                wanted[offset - first] = 1
        needed: dict[int, bytes | memoryview] = {}

        def take(page: Sequence[tuple[int, bytes | memoryview]]) -> None:
            for offset, record in page:
                if first <= offset < end and wanted[offset - first]:
                    needed[offset] = record

        def compose(episodes: Sequence[str]) -> Iterator[EpisodeProjection]:
            # One at a time as the consumer asks: a page may pass thousands of episodes, and
            # their projections' payload copies all held at once cost more than the lines.
            for episode in episodes:
                item = mine[episode]
                projection = None
                if trackers is None or (
                    trackers.get(episode) is item.state and item.state.version == item.version
                ):
                    try:
                        projection = compose_projection(
                            item.state, needed, item.cut, record_payload_start, peek_record
                        )
                    except Exception:  # a record that is not what the tracker saw
                        logger.exception("run %s: could not compose episode %s", run, episode)
                for offset in item.positions:
                    needed.pop(offset, None)
                if projection is None:
                    failed.append(episode)
                else:
                    yield projection

        return take, compose

    reads = {}
    for partition, mine in by_partition.items():
        # An episode is whole once the read has passed its last position.
        ends = {e: max(item.positions, default=-1) + 1 for e, item in mine.items()}
        first = min(min(item.positions, default=0) for item in mine.values())
        reads[partition] = _PartitionRead(
            first, ends, collect(mine, first, max(ends.values(), default=first))
        )
    async for projection in _read_partitions(log, run, reads, in_place=True):
        yield projection


class Composable(NamedTuple):
    """An episode ``compose_stream`` composes: where its records are, and the state its
    projection is composed from once they are read (as it was at ``version``)."""

    episode: str
    partition: int
    cut: int
    #: The offsets of its records (``projection_positions`` of its state at ``version``).
    positions: tuple[int, ...]
    state: EpisodeFold
    version: int

    @classmethod
    def of(cls, entry: ManifestEntry, state: EpisodeFold) -> Composable:
        """The episode of ``entry`` composed from ``state`` as it is now (``composable``)."""
        return cls(
            entry.episode,
            entry.cut_partition,
            entry.cut_offset,
            tuple(projection_positions(state)),
            state,
            state.version,
        )


#: How a partition's read hands its records over: ``take`` a page, then ``emit`` the episodes
#: whose records the read has passed (their projections).
_Collect = tuple[
    Callable[[Sequence[tuple[int, bytes | memoryview]]], None],
    Callable[[Sequence[str]], Iterable[EpisodeProjection]],
]


class _PartitionRead(NamedTuple):
    #: Where the read starts.
    start: int
    #: Per episode, the offset past its last record: once the read is past it, the episode is
    #: whole (the read ends at the largest).
    ends: Mapping[str, int]
    collect: _Collect


#: How many partitions are read (each holding at most a page being built from) at once: the
#: reads overlap the building, and a replay does not hold every partition's page at once.
_READS_AT_ONCE = 2


async def _read_partitions(
    log: Log, run: str, reads: Mapping[int, _PartitionRead], *, in_place: bool
) -> AsyncIterator[EpisodeProjection]:
    """Read each partition's range (in parallel), hand its pages to its ``collect`` and yield
    the projections it emits as the read passes each episode's end. A partition reads its next
    page once the projections it emitted are taken: a read never runs ahead of what is built
    from it (measured on S1: readers 8 MB pages ahead held ~20 MB more at the peak).
    ``in_place``: the log's large records as read-only views of its storage
    (``Log.read_pages_in_place``), for a composition that passes them on as they are."""
    ready: asyncio.Queue[
        tuple[Iterable[EpisodeProjection], asyncio.Event] | BaseException | None
    ] = asyncio.Queue()
    reading = asyncio.Semaphore(_READS_AT_ONCE)

    async def one(read: _PartitionRead, partition: int) -> None:
        try:
            take, emit = read.collect
            ends = read.ends
            # Episodes by end: once the read is past an episode's end it has all its records.
            by_end = sorted(ends, key=ends.__getitem__)
            done = 0
            # A partition holds its slot for its whole read: a log's page reader may hold a
            # connection between pages (the embedded log's pool is not larger than the slots).
            async with reading:
                read_pages = log.read_pages_in_place if in_place else log.read_pages
                async for page in read_pages(run, partition, read.start, ends[by_end[-1]]):
                    take(page)
                    if not page:
                        continue
                    last = page[-1][0]
                    passed = done
                    while passed < len(by_end) and ends[by_end[passed]] <= last:
                        passed += 1
                    del page  # (what is built from it is kept by ``take``)
                    if passed > done:
                        taken = asyncio.Event()
                        ready.put_nowait((emit(by_end[done:passed]), taken))
                        done = passed
                        await taken.wait()
                if done < len(by_end):
                    taken = asyncio.Event()
                    ready.put_nowait((emit(by_end[done:]), taken))
                    await taken.wait()
            ready.put_nowait(None)
        except BaseException as e:  # handed to the reader, which raises it
            ready.put_nowait(e)
            raise

    tasks = [asyncio.create_task(one(read, p)) for p, read in reads.items() if read.ends]
    try:
        running = len(tasks)
        while running:
            item = await ready.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                projections, taken = item
                for projection in projections:
                    yield projection
                taken.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
