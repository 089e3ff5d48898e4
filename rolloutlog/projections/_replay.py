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
from collections.abc import AsyncIterator, Collection, Mapping, Sequence

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import EpisodeProjection
from rolloutlog.log import Log, record_episode
from rolloutlog.projections._fold import project_raw

logger = logging.getLogger(__name__)

__all__ = ["replay_at_cuts", "replay_stream"]


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
    ready: asyncio.Queue[list[EpisodeProjection] | BaseException | None] = asyncio.Queue()

    def fold(
        episodes: Sequence[str], cuts: dict[str, int], records: dict[str, list[tuple[int, bytes]]]
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

    async def one(partition: int, cuts: dict[str, int]) -> None:
        try:
            records: dict[str, list[tuple[int, bytes]]] = {episode: [] for episode in cuts}
            # Episodes by cut: once the read is past an episode's cut it has all its records.
            by_cut = sorted(cuts, key=cuts.__getitem__)
            done = 0
            end = cuts[by_cut[-1]]
            start = replay_from.get(partition, 0)
            async for page in log.read_pages(run, partition, start, end):
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
                if not page:
                    continue
                last = page[-1][0]
                passed = done
                while passed < len(by_cut) and cuts[by_cut[passed]] <= last:
                    passed += 1
                if passed > done:
                    ready.put_nowait(fold(by_cut[done:passed], cuts, records))
                    done = passed
            ready.put_nowait(fold(by_cut[done:], cuts, records))
            ready.put_nowait(None)
        except BaseException as e:  # handed to the reader, which raises it
            ready.put_nowait(e)
            raise

    tasks = [asyncio.create_task(one(p, cuts)) for p, cuts in by_partition.items()]
    try:
        running = len(tasks)
        while running:
            item = await ready.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                for projection in item:
                    yield projection
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
