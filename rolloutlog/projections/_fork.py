"""Forking a run: a new run whose first committed checkpoint is another run's committed
checkpoint restricted to the live episodes chosen (docs/design.md §8, "Forks").

The fork never depends on its source afterwards. So it reads the source's log once, here:
every record that a restore of the source's checkpoint would fold for a forked episode (the
partition's replay range, the episode's records below its cut, quarantined positions and
``attempt.started`` records of restores that never committed left out) is appended to the
fork's own log, in the same partition and order. The copied ``attempt.started`` records are the
one rewrite: their cut is a position in the source's log, so it becomes the position of the
same record in the fork's, and their restore, which committed in the source, becomes the fork's
inherited restore (``FORK_RESTORE_ID``, which every fork counts as committed). Then a marker
goes into every partition of the fork's log and the catalog commits, in one transaction, the
fork's checkpoint 1 with its cuts in the fork's log (``Catalog.commit_fork``).

A fork is created whole or not at all: its catalog row claims the name first and stays unseen
until that commit. A fork that failed or whose service died before it (the claim is left) is
created afresh when asked again: its log, which nothing else knew of, is deleted and copied
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rolloutlog.catalog import (
    FORK_CHECKPOINT_ID,
    FORK_RESTORE_ID,
    Catalog,
    Checkpoint,
    ManifestEntry,
    PartitionOffset,
    Run,
)
from rolloutlog.core import replay_start
from rolloutlog.errors import InvalidRequest, UnknownCheckpoint, UnknownEpisode, UnknownRun
from rolloutlog.log import (
    Log,
    Record,
    attempt_started_record,
    peek_record,
    record_episode,
    record_restore_id,
)
from rolloutlog.projections._manifest_writer import staging_keys
from rolloutlog.projections._start_plan import all_restores

logger = logging.getLogger(__name__)

__all__ = ["ForkRequest", "ForkResult", "fork_run"]

#: Records per append while copying (a flush comes earlier when an ``attempt.started`` needs
#: the position of a record still waiting).
COPY_BATCH = 4096


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """Fork ``source`` at ``checkpoint`` (an id or ``"latest"``): its live episodes, or only
    those of ``episodes``, minus ``exclude``."""

    source: str
    checkpoint: int | Literal["latest"] = "latest"
    episodes: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The request as the catalog keeps it (``runs.fork_request``)."""
        return {
            "run": self.source,
            "checkpoint_id": self.checkpoint,
            "episodes": None if self.episodes is None else sorted(set(self.episodes)),
            "exclude": sorted(set(self.exclude)),
        }


@dataclass(frozen=True, slots=True)
class ForkResult:
    """The fork's run, and whether this request created it (False: it existed, the same)."""

    run: Run
    created: bool
    #: Forked episodes per action, and the records copied into the fork's log.
    counts: dict[str, int] = field(default_factory=dict)
    #: Every staging key the fork's checkpoint 1 references, as a checkpoint's reply lists
    #: them (the source's keys, unrenamed: ledger rows name them); None once that checkpoint
    #: is no longer kept (the fork's later checkpoints list theirs).
    staging_keys: tuple[str, ...] | None = None


CommittedCheckpoint = Callable[[str, int | str], Awaitable[Checkpoint]]


async def fork_run(
    log: Log,
    catalog: Catalog,
    run: str,
    request: ForkRequest,
    *,
    committed_checkpoint: CommittedCheckpoint,
    partitions: int | None = None,
    replica_id: str | None = None,
) -> ForkResult:
    """Create ``run`` as a fork (idempotent for the same request; ``RunExists`` for a run of
    that name that is not this fork) as the replica ``replica_id``, which holds the fork's
    claim while it copies (another replica asked for the same fork meanwhile answers
    ``fork_in_progress``, ``catalog/_forks.py``). ``committed_checkpoint`` resolves the
    source's checkpoint as a restore does (``committed_checkpoint`` of
    ``_projection_server.py``). The caller holds the run's lock (``Coordinator.fork_run``): one
    try at a time in this process; the claim fences replicas."""
    source = await catalog.get_run(request.source)
    if partitions is not None and partitions != source.partitions:
        raise InvalidRequest(
            f"a fork has its source's partitions ({source.partitions}), not {partitions}",
            field="partitions",
            source_partitions=source.partitions,
        )
    if request.source == run:
        raise InvalidRequest("a run cannot be forked into itself", field="fork")
    checkpoint = await committed_checkpoint(request.source, request.checkpoint)
    # Checked before the name is claimed: a refused request leaves nothing behind.
    entries = _chosen(
        await catalog.load_manifest(request.source, checkpoint.checkpoint_id), request
    )
    claimed = await catalog.claim_fork(
        run,
        source=request.source,
        checkpoint_id=checkpoint.checkpoint_id,
        partitions=source.partitions,
        log_url=log.url,
        request=request.as_json(),
        claimed_by=replica_id,
    )
    if claimed.state == "created":
        return ForkResult(claimed.run, created=False, staging_keys=await _first_keys(catalog, run))
    if claimed.taken_over_from is not None:
        logger.info("fork %s: took the claim over from %s", run, claimed.taken_over_from)
    try:
        if claimed.run.forked_from_checkpoint != checkpoint.checkpoint_id:
            # The retry of a claim made for an older "latest": the claim's checkpoint it is.
            checkpoint = await committed_checkpoint(
                request.source, claimed.run.forked_from_checkpoint or checkpoint.checkpoint_id
            )
            entries = _chosen(
                await catalog.load_manifest(request.source, checkpoint.checkpoint_id), request
            )
        created, copied = await _copy_and_commit(
            log,
            catalog,
            run,
            request,
            source,
            checkpoint,
            entries,
            committed_checkpoint,
            replica_id,
        )
    except BaseException:
        # Nothing of a refused or failed try stays: the name is free again (a crash leaves the
        # claim, and the next try of the same fork starts afresh).
        with contextlib.suppress(Exception):
            await asyncio.shield(_release(log, catalog, run, replica_id))
        raise
    counts = {
        "continue": sum(e.action == "continue" for e in copied.entries),
        "restart": sum(e.action == "restart" for e in copied.entries),
        "records": copied.records,
    }
    logger.info(
        "forked run %s from %s checkpoint %d: %s",
        run,
        request.source,
        checkpoint.checkpoint_id,
        counts,
    )
    return ForkResult(
        created, created=True, counts=counts, staging_keys=staging_keys(copied.entries)
    )


async def _first_keys(catalog: Catalog, run: str) -> tuple[str, ...] | None:
    """The staging keys of the fork's checkpoint 1, None once it is no longer kept."""
    try:
        return staging_keys(await catalog.load_manifest(run, FORK_CHECKPOINT_ID))
    except UnknownCheckpoint:
        return None


async def _copy_and_commit(
    log: Log,
    catalog: Catalog,
    run: str,
    request: ForkRequest,
    source: Run,
    checkpoint: Checkpoint,
    entries: list[ManifestEntry],
    committed_checkpoint: CommittedCheckpoint,
    replica_id: str | None,
) -> tuple[Run, _Copied]:
    # What a crashed try left in the fork's log (nothing else knew of it) goes first.
    if await log.delete_run(run):
        logger.info("fork %s: deleted the log a failed try left", run)
    await log.ensure_run(run, source.partitions)
    committed = {r.restore_id for r in await all_restores(catalog, request.source)}
    quarantined = {
        (q.partition, q.offset) for q in await catalog.quarantined(request.source, limit=None)
    }
    copier = _Copier(log, run, committed)
    starts = replay_start(checkpoint.offsets)
    by_partition: dict[int, list[ManifestEntry]] = defaultdict(list)
    for entry in entries:
        by_partition[entry.cut_partition].append(entry)
    for partition in sorted(by_partition):
        cuts = {entry.episode: entry.cut_offset for entry in by_partition[partition]}
        await copier.copy(request.source, partition, starts.get(partition, 0), cuts, quarantined)
    # The source trims its log below its oldest retained checkpoint, and only once a newer
    # one made this one expire; a read of trimmed records skips them. So the copy holds every
    # record only if the checkpoint is still retained now that the reads are over.
    try:
        await committed_checkpoint(request.source, checkpoint.checkpoint_id)
    except (UnknownCheckpoint, UnknownRun) as e:
        raise UnknownCheckpoint(
            f"checkpoint {checkpoint.checkpoint_id} of run {request.source!r} expired (or the "
            "run was deleted) while the fork copied it: its log may have been trimmed under "
            "the copy. Nothing was created; fork a newer checkpoint",
            run=request.source,
            checkpoint_id=checkpoint.checkpoint_id,
        ) from e
    markers = await log.write_markers(run, FORK_CHECKPOINT_ID, 0)
    offsets = [
        PartitionOffset(partition, marker, copier.first.get(partition, marker))
        for partition, marker in enumerate(markers)
    ]
    forked = [
        entry._replace(cut_offset=copier.cut_of(entry.episode, markers[entry.cut_partition]))
        for entry in entries
    ]
    first = {e: positions[0] for e, (_, positions) in copier.copied.items() if positions}
    created = await catalog.commit_fork(run, offsets, forked, first, claimed_by=replica_id)
    return created, _Copied(forked, copier.count)


async def _release(log: Log, catalog: Catalog, run: str, replica_id: str | None) -> None:
    """Give up a claimed fork: its row, then its log (only while it is still being created
    and the claim is still ``replica_id``'s: a fork whose commit went through keeps both, and
    so does the claim another replica took over)."""
    if await catalog.release_fork(run, claimed_by=replica_id):
        await log.delete_run(run)


@dataclass(frozen=True, slots=True)
class _Copied:
    entries: list[ManifestEntry]
    records: int


def _chosen(manifest: Sequence[ManifestEntry], request: ForkRequest) -> list[ManifestEntry]:
    """The manifest's live entries the request forks (``UnknownEpisode`` for a named episode
    that is not live in it)."""
    live = {entry.episode: entry for entry in manifest if entry.action != "finished"}
    named = [*(request.episodes or ()), *request.exclude]
    unknown = sorted({episode for episode in named if episode not in live})
    if unknown:
        raise UnknownEpisode(
            f"episodes not live at the checkpoint: {', '.join(unknown[:10])}",
            episodes=unknown[:100],
        )
    wanted = set(live) if request.episodes is None else set(request.episodes)
    wanted -= set(request.exclude)
    return [live[episode] for episode in sorted(wanted)]


class _Copier:
    """Copies the forked episodes' records of one partition after another into the fork's log,
    and knows where each landed."""

    def __init__(self, log: Log, run: str, committed: set[int]) -> None:
        self.log = log
        self.run = run
        self.committed = committed
        #: Per episode: the source offsets of its copied records and their fork offsets (the
        #: latter filled as their appends return).
        self.copied: dict[str, tuple[list[int], list[int]]] = {}
        #: Per partition, the fork's offset of its first copied record.
        self.first: dict[int, int] = {}
        self.count = 0
        self._pending: list[tuple[str, Record]] = []

    async def copy(
        self,
        source: str,
        partition: int,
        start: int,
        cuts: dict[str, int],
        quarantined: set[tuple[int, int]],
    ) -> None:
        end = max(cuts.values())
        async for page in self.log.read_pages(source, partition, start, end):
            for offset, raw in page:
                if (partition, offset) in quarantined:
                    continue  # a restore's replay skips it: so does the copy
                try:
                    episode = record_episode(raw)
                except ValueError:  # not an envelope (quarantined in the source)
                    continue
                if episode is None or offset >= cuts.get(episode, -1):
                    continue
                restore_id = record_restore_id(raw)
                if restore_id is not None:
                    if restore_id not in self.committed:
                        continue  # a restore that never committed changes nothing
                    raw = await self._rebased(episode, raw)
                self._add(partition, episode, offset, raw)
                if len(self._pending) >= COPY_BATCH:
                    await self._flush()
        await self._flush()

    def _add(self, partition: int, episode: str, offset: int, raw: bytes) -> None:
        sources, _ = self.copied.setdefault(episode, ([], []))
        sources.append(offset)
        self._pending.append((episode, Record(partition, episode.encode(), raw)))

    async def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        positions = await self.log.append_records(self.run, [record for _, record in pending])
        for (episode, _), position in zip(pending, positions, strict=True):
            self.copied[episode][1].append(position.offset)
            self.first.setdefault(position.partition, position.offset)
        self.count += len(pending)

    async def _rebased(self, episode: str, raw: bytes) -> bytes:
        """An ``attempt.started`` of the source in the fork's terms: its cut at the fork's
        position of the same record, its restore the fork's inherited one."""
        meta, _ = peek_record(raw)
        data = meta["data"]
        sources, positions = self.copied.get(episode, ([], []))
        below = bisect_left(sources, data["cut"])  # the episode's records the cut keeps
        if below > len(positions):
            await self._flush()
            sources, positions = self.copied[episode]
        cut = positions[below - 1] + 1 if below else 0
        return attempt_started_record(
            episode,
            meta["attempt"],
            restore_id=FORK_RESTORE_ID,
            checkpoint_id=data["checkpoint_id"],
            previous_attempt=data["previous_attempt"],
            cut=cut,
            controller_epoch=meta["participant"]["epoch"],
            ts=meta["ts"],
        )

    def cut_of(self, episode: str, marker: int) -> int:
        """The fork's cut of a forked episode: just past its last copied record (its records
        before its cut in the source are exactly those copied), else the marker."""
        positions = self.copied.get(episode, ([], []))[1]
        return positions[-1] + 1 if positions else marker
