"""Replaying a checkpoint: every named episode's records folded at its cut, read from the log
(partitions in parallel). The restore runner and the projection doors use it."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import ManifestEntry
from rolloutlog.log import Log, record_episode
from rolloutlog.projections._fold import project_raw
from rolloutlog.projections._model import EpisodeProjection

logger = logging.getLogger(__name__)

__all__ = ["replay_at_cuts"]


async def replay_at_cuts(
    log: Log,
    run: str,
    entries: Sequence[ManifestEntry],
    replay_from: Mapping[int, int],
    committed_restores: set[int],
    *,
    quarantined: Collection[tuple[int, int]] = frozenset(),
    attempts: Mapping[str, int] | None = None,
) -> dict[str, EpisodeProjection]:
    """Fold every named episode at its cut; partitions are read in parallel from
    ``replay_from`` (``replay_start``). ``quarantined`` positions are skipped (the projector
    skipped them); ``attempts`` labels each projection with the attempt that continues it. An
    episode with no records before its cut, or one the fold cannot apply, has no projection."""
    by_partition: dict[int, dict[str, int]] = defaultdict(dict)
    at_cut: dict[str, int] = {}
    for entry in entries:
        by_partition[entry.cut_partition][entry.episode] = entry.cut_offset
        at_cut[entry.episode] = entry.attempt

    async def one(partition: int, cuts: dict[str, int]) -> dict[str, EpisodeProjection]:
        records: dict[str, list[tuple[int, bytes]]] = {episode: [] for episode in cuts}
        end = max(cuts.values())
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
