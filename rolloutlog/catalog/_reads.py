"""Read queries: each takes a connection inside one read transaction (one snapshot)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, cast

import orjson
from sqlalchemy import Row, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog._gc import collector_paused
from rolloutlog.catalog._schema import (
    RUN_VISIBLE,
    checkpoint_offsets,
    checkpoint_parts,
    checkpoints,
    episodes,
    manifest_chain,
    manifest_entries,
    manifest_parts,
    participants,
    quarantined_records,
    restore_episodes,
    restores,
    runs,
)
from rolloutlog.catalog._values import (
    REMOVED,
    Checkpoint,
    CheckpointStatus,
    Episode,
    EpisodeStatus,
    ManifestAction,
    ManifestEntry,
    ParticipantKind,
    PartitionOffset,
    QuarantinedRecord,
    RegisteredParticipant,
    Restore,
    RestoreAction,
    RestoreEntry,
    Run,
    RunStats,
    RunSummary,
)
from rolloutlog.errors import UnknownCheckpoint, UnknownEpisode, UnknownRestore, UnknownRun


def decode_json_map(raw: str | None) -> dict[str, float]:
    return cast(dict[str, float], orjson.loads(raw)) if raw else {}


def run_from_row(row: Row[Any]) -> Run:
    return Run(
        run=row.run,
        partitions=row.partitions,
        log_url=row.log_url,
        controller_epoch=row.controller_epoch,
        latest_checkpoint_id=row.latest_checkpoint_id,
        created_at=row.created_at,
        forked_from_run=row.forked_from_run,
        forked_from_checkpoint=row.forked_from_checkpoint,
        forked_at=row.forked_at,
    )


def checkpoint_from_row(row: Row[Any], offsets: Sequence[PartitionOffset]) -> Checkpoint:
    return Checkpoint(
        run=row.run,
        checkpoint_id=row.checkpoint_id,
        status=cast(CheckpointStatus, row.status),
        trigger=row.trigger,
        controller_epoch=row.controller_epoch,
        deadline_s=row.deadline_s,
        requested_at=row.requested_at,
        marked_at=row.marked_at,
        committed_at=row.committed_at,
        ended_at=row.ended_at,
        continue_count=row.continue_count,
        restart_count=row.restart_count,
        finished_count=row.finished_count,
        entry_count=row.entry_count,
        size_bytes=row.size_bytes,
        reason=row.reason,
        timings_ms=decode_json_map(row.timings_ms),
        offsets=tuple(offsets),
        request_id=row.request_id,
    )


def restore_from_row(row: Row[Any]) -> Restore:
    return Restore(
        run=row.run,
        restore_id=row.restore_id,
        checkpoint_id=row.checkpoint_id,
        controller_epoch=row.controller_epoch,
        committed_at=row.committed_at,
        continue_count=row.continue_count,
        restart_count=row.restart_count,
        excluded_count=row.excluded_count,
        timings_ms=decode_json_map(row.timings_ms),
    )


def episode_from_row(row: Row[Any]) -> Episode:
    return Episode(
        run=row.run,
        episode=row.episode,
        current_attempt=row.current_attempt,
        status=cast(EpisodeStatus, row.status),
        first_partition=row.first_partition,
        first_offset=row.first_offset,
        started_at=row.started_at,
        finished_at=row.finished_at,
        updated_at=row.updated_at,
        forked_attempt=row.forked_attempt,
    )


async def get_run(conn: AsyncConnection, run: str) -> Run:
    query = select(runs).where(runs.c.run == run, RUN_VISIBLE)
    row = (await conn.execute(query)).one_or_none()
    if row is None:
        raise UnknownRun(f"no run {run!r}", run=run)
    return run_from_row(row)


async def list_runs(conn: AsyncConnection, after: str | None, limit: int) -> list[RunSummary]:
    query = select(runs).where(RUN_VISIBLE).order_by(runs.c.run).limit(limit)
    if after is not None:
        query = query.where(runs.c.run > after)
    return await summarize_runs(conn, [run_from_row(row) for row in await conn.execute(query)])


async def summarize_runs(conn: AsyncConnection, found: list[Run]) -> list[RunSummary]:
    if not found:
        return []
    names = [run.run for run in found]
    participant_counts = await _count_by_run(conn, participants.c.run, names)
    restore_counts = await _count_by_run(conn, restores.c.run, names)
    episode_counts = await _count_by_run(conn, episodes.c.run, names)
    checkpoint_counts: dict[str, dict[str, int]] = {name: {} for name in names}
    rows = await conn.execute(
        select(checkpoints.c.run, checkpoints.c.status, func.count())
        .where(checkpoints.c.run.in_(names))
        .group_by(checkpoints.c.run, checkpoints.c.status)
    )
    for name, status, count in rows:
        checkpoint_counts[name][status] = count
    return [
        RunSummary(
            run=run,
            participant_count=participant_counts.get(run.run, 0),
            checkpoint_counts=checkpoint_counts[run.run],
            restore_count=restore_counts.get(run.run, 0),
            episode_count=episode_counts.get(run.run, 0),
        )
        for run in found
    ]


async def _count_by_run(conn: AsyncConnection, column: Any, names: list[str]) -> dict[str, int]:
    rows = await conn.execute(
        select(column, func.count()).where(column.in_(names)).group_by(column)
    )
    return {name: count for name, count in rows}


async def list_participants(conn: AsyncConnection, run: str) -> list[RegisteredParticipant]:
    await get_run(conn, run)
    rows = await conn.execute(
        select(participants)
        .where(participants.c.run == run)
        .order_by(participants.c.participant_id)
    )
    return [
        RegisteredParticipant(
            run=row.run,
            participant_id=row.participant_id,
            kind=cast(ParticipantKind, row.kind),
            epoch=row.epoch,
            registered_at=row.registered_at,
            last_seen_at=row.last_seen_at,
        )
        for row in rows
    ]


async def offsets_of(
    conn: AsyncConnection, run: str, checkpoint_ids: Sequence[int]
) -> dict[int, list[PartitionOffset]]:
    found: dict[int, list[PartitionOffset]] = {cid: [] for cid in checkpoint_ids}
    if not checkpoint_ids:
        return found
    rows = await conn.execute(
        select(
            checkpoint_offsets.c.checkpoint_id,
            checkpoint_offsets.c.partition,
            checkpoint_offsets.c.marker_offset,
            checkpoint_offsets.c.replay_from,
        )
        .where(
            checkpoint_offsets.c.run == run,
            checkpoint_offsets.c.checkpoint_id.in_(checkpoint_ids),
        )
        .order_by(checkpoint_offsets.c.checkpoint_id, checkpoint_offsets.c.partition)
    )
    for checkpoint_id, partition, marker, replay_from in rows:
        found[checkpoint_id].append(PartitionOffset(partition, marker, replay_from))
    return found


async def get_checkpoint(conn: AsyncConnection, run: str, checkpoint_id: int) -> Checkpoint:
    row = (
        await conn.execute(
            select(checkpoints).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).one_or_none()
    if row is None:
        await get_run(conn, run)
        raise UnknownCheckpoint(
            f"run {run!r} has no checkpoint {checkpoint_id}", run=run, checkpoint_id=checkpoint_id
        )
    offsets = await offsets_of(conn, run, [checkpoint_id])
    return checkpoint_from_row(row, offsets[checkpoint_id])


async def written_parts(conn: AsyncConnection, run: str, checkpoint_id: int) -> frozenset[int]:
    found = await conn.execute(
        select(checkpoint_parts.c.partition).where(
            checkpoint_parts.c.run == run, checkpoint_parts.c.checkpoint_id == checkpoint_id
        )
    )
    return frozenset(int(partition) for partition in found.scalars())


async def latest_checkpoint(conn: AsyncConnection, run: str) -> Checkpoint:
    latest = (await get_run(conn, run)).latest_checkpoint_id
    if latest is None:
        raise UnknownCheckpoint(f"run {run!r} has no committed checkpoint", run=run)
    return await get_checkpoint(conn, run, latest)


async def list_checkpoints(
    conn: AsyncConnection,
    run: str,
    status: CheckpointStatus | None,
    before: int | None,
    limit: int,
    request_id: str | None = None,
) -> list[Checkpoint]:
    await get_run(conn, run)
    query = (
        select(checkpoints)
        .where(checkpoints.c.run == run)
        .order_by(checkpoints.c.checkpoint_id.desc())
        .limit(limit)
    )
    if status is not None:
        query = query.where(checkpoints.c.status == status)
    if before is not None:
        query = query.where(checkpoints.c.checkpoint_id < before)
    if request_id is not None:
        query = query.where(checkpoints.c.request_id == request_id)
    rows = (await conn.execute(query)).all()
    offsets = await offsets_of(conn, run, [row.checkpoint_id for row in rows])
    return [checkpoint_from_row(row, offsets[row.checkpoint_id]) for row in rows]


async def require_committed(conn: AsyncConnection, run: str, checkpoint_id: int) -> None:
    """Raise unless the checkpoint is committed, i.e. its whole manifest is there to read."""
    status = (
        await conn.execute(
            select(checkpoints.c.status).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).scalar_one_or_none()
    if status == "committed":
        return
    if status is None:
        await get_run(conn, run)
        raise UnknownCheckpoint(
            f"run {run!r} has no checkpoint {checkpoint_id}", run=run, checkpoint_id=checkpoint_id
        )
    raise UnknownCheckpoint(
        f"checkpoint {checkpoint_id} of run {run!r} is {status}: it has no manifest",
        run=run,
        checkpoint_id=checkpoint_id,
        status=status,
    )


async def manifest_page(
    conn: AsyncConnection,
    run: str,
    checkpoint_id: int,
    after: str | None,
    limit: int | None,
    action: ManifestAction | None = None,
) -> list[ManifestEntry]:
    await require_committed(conn, run, checkpoint_id)
    bodies, chained = await manifest_bodies(conn, run, checkpoint_id)
    with collector_paused():
        return manifest_entries_from_parts(bodies, after, limit, action, chained=chained)


#: A chain row's part: its ancestor's part of the chain's partition.
_CHAINED = (
    (manifest_parts.c.run == manifest_chain.c.run)
    & (manifest_parts.c.checkpoint_id == manifest_chain.c.ancestor_id)
    & (manifest_parts.c.cut_partition == manifest_chain.c.partition)
)


async def manifest_bodies(
    conn: AsyncConnection, run: str, checkpoint_id: int
) -> tuple[list[str], bool]:
    """The packed parts a committed checkpoint's manifest is made of, the oldest members of its
    partitions' chains first (``manifest_chain``; an episode lives in one partition, so this
    orders each chain), and whether any chain has more than one member."""
    rows = (
        await conn.execute(
            select(manifest_chain.c.depth, manifest_parts.c.entries)
            .join(manifest_parts, _CHAINED)
            .where(manifest_chain.c.run == run, manifest_chain.c.checkpoint_id == checkpoint_id)
            .order_by(manifest_chain.c.depth.desc())
        )
    ).all()
    return [row[1] for row in rows], any(row[0] for row in rows)


def compose_parts(bodies: Sequence[str]) -> list[list[Any]]:
    """The raw entries of a chain's packed parts (oldest first): per episode the newest, and
    none for an episode whose newest is a ``removed`` tombstone."""
    newest = {entry[0]: entry for body in bodies for entry in orjson.loads(body)}
    return [entry for entry in newest.values() if entry[2] != REMOVED]


def entries_from_raw(raw: Sequence[list[Any]]) -> list[ManifestEntry]:
    """Packed entries (JSON arrays, decoded) as ``ManifestEntry`` values."""
    new = tuple.__new__
    return [
        new(
            ManifestEntry,
            (e[0], e[1], e[2], e[3], e[4], e[5], tuple(e[6]), e[7], e[8] if len(e) > 8 else None),
        )
        for e in raw
    ]


def manifest_entries_from_parts(
    bodies: Sequence[str],
    after: str | None = None,
    limit: int | None = None,
    action: ManifestAction | None = None,
    *,
    chained: bool = False,
) -> list[ManifestEntry]:
    """The entries of a manifest's packed rows in episode order (the rows of the
    ``manifest_entries`` view, ordered by episode), from after ``after``, of ``action``, at most
    ``limit``; ``chained``: the rows are a chain's, oldest first (``compose_parts``). Built for
    speed: 16,000 per read, by ``tuple.__new__`` rather than the NamedTuple's Python-level
    ``__new__``."""
    raw = compose_parts(bodies) if chained else [e for body in bodies for e in orjson.loads(body)]
    entries = entries_from_raw(raw)
    by_episode = itemgetter(0)
    entries.sort(key=by_episode)  # each part is in episode order already: a merge, in effect
    if after is not None:
        entries = entries[bisect_right(entries, after, key=by_episode) :]
    if action is not None:
        entries = [entry for entry in entries if entry[2] == action]
    if limit is not None:
        del entries[limit:]
    return entries


async def staging_keys(conn: AsyncConnection, run: str) -> frozenset[str]:
    await get_run(conn, run)
    rows = await conn.execute(
        select(manifest_entries.c.staging_keys)
        .join(
            checkpoints,
            (checkpoints.c.run == manifest_entries.c.run)
            & (checkpoints.c.checkpoint_id == manifest_entries.c.checkpoint_id),
        )
        .where(
            manifest_entries.c.run == run,
            checkpoints.c.status == "committed",
            manifest_entries.c.staging_keys.is_not(None),
        )
    )
    keys: set[str] = set()
    for (raw,) in rows:
        keys.update(orjson.loads(raw))
    return frozenset(keys)


async def get_restore(conn: AsyncConnection, run: str, restore_id: int) -> Restore:
    row = (
        await conn.execute(
            select(restores).where(restores.c.run == run, restores.c.restore_id == restore_id)
        )
    ).one_or_none()
    if row is None:
        await get_run(conn, run)
        raise UnknownRestore(
            f"run {run!r} has no restore {restore_id}", run=run, restore_id=restore_id
        )
    return restore_from_row(row)


async def list_restores(
    conn: AsyncConnection, run: str, before: int | None, limit: int
) -> list[Restore]:
    await get_run(conn, run)
    query = (
        select(restores)
        .where(restores.c.run == run)
        .order_by(restores.c.restore_id.desc())
        .limit(limit)
    )
    if before is not None:
        query = query.where(restores.c.restore_id < before)
    return [restore_from_row(row) for row in await conn.execute(query)]


async def restore_entries(
    conn: AsyncConnection,
    run: str,
    restore_id: int,
    action: RestoreAction | None,
    after: str | None,
    limit: int | None,
) -> list[RestoreEntry]:
    await get_restore(conn, run, restore_id)
    query = (
        select(
            restore_episodes.c.episode,
            restore_episodes.c.previous_attempt,
            restore_episodes.c.attempt,
            restore_episodes.c.action,
            restore_episodes.c.reason,
        )
        .where(restore_episodes.c.run == run, restore_episodes.c.restore_id == restore_id)
        .order_by(restore_episodes.c.episode)
    )
    if action is not None:
        query = query.where(restore_episodes.c.action == action)
    if after is not None:
        query = query.where(restore_episodes.c.episode > after)
    if limit is not None:
        query = query.limit(limit)
    result = await conn.execute(query)
    return [RestoreEntry(*row) for row in result]


async def get_episode(conn: AsyncConnection, run: str, episode: str) -> Episode:
    row = (
        await conn.execute(
            select(episodes).where(episodes.c.run == run, episodes.c.episode == episode)
        )
    ).one_or_none()
    if row is None:
        await get_run(conn, run)
        raise UnknownEpisode(f"run {run!r} has no episode {episode!r}", run=run, episode=episode)
    return episode_from_row(row)


async def list_episodes(
    conn: AsyncConnection, run: str, status: EpisodeStatus | None, after: str | None, limit: int
) -> list[Episode]:
    await get_run(conn, run)
    query = select(episodes).where(episodes.c.run == run).order_by(episodes.c.episode).limit(limit)
    if status is not None:
        query = query.where(episodes.c.status == status)
    if after is not None:
        query = query.where(episodes.c.episode > after)
    return [episode_from_row(row) for row in await conn.execute(query)]


async def current_attempts(conn: AsyncConnection, run: str) -> dict[str, int]:
    await get_run(conn, run)
    result = await conn.execute(
        select(episodes.c.episode, episodes.c.current_attempt).where(episodes.c.run == run)
    )
    return dict(result.all())


async def run_stats(conn: AsyncConnection, run: str) -> RunStats:
    found = await get_run(conn, run)
    participant_count = (
        await conn.execute(select(func.count()).where(participants.c.run == run))
    ).scalar_one()
    checkpoint_counts = {
        status: count
        for status, count in await conn.execute(
            select(checkpoints.c.status, func.count())
            .where(checkpoints.c.run == run)
            .group_by(checkpoints.c.status)
        )
    }
    episode_counts = {
        status: count
        for status, count in await conn.execute(
            select(episodes.c.status, func.count())
            .where(episodes.c.run == run)
            .group_by(episodes.c.status)
        )
    }
    restore_count, last_restore_at = (
        await conn.execute(
            select(func.count(), func.max(restores.c.committed_at)).where(restores.c.run == run)
        )
    ).one()
    duration_ms = (checkpoints.c.committed_at - checkpoints.c.requested_at) * 1000.0
    mean_ms, max_ms = (
        await conn.execute(
            select(func.avg(duration_ms), func.max(duration_ms)).where(
                checkpoints.c.run == run, checkpoints.c.committed_at.is_not(None)
            )
        )
    ).one()
    latest = None
    if found.latest_checkpoint_id is not None:
        latest = (
            await conn.execute(
                select(
                    checkpoints.c.entry_count, checkpoints.c.size_bytes, duration_ms.label("ms")
                ).where(
                    checkpoints.c.run == run,
                    checkpoints.c.checkpoint_id == found.latest_checkpoint_id,
                )
            )
        ).one()
    return RunStats(
        run=run,
        participant_count=participant_count,
        checkpoint_counts=checkpoint_counts,
        episode_counts=episode_counts,
        restore_count=restore_count,
        latest_checkpoint_id=found.latest_checkpoint_id,
        latest_entry_count=latest.entry_count if latest is not None else 0,
        latest_size_bytes=latest.size_bytes if latest is not None else 0,
        checkpoint_duration_ms_mean=float(mean_ms) if mean_ms is not None else None,
        checkpoint_duration_ms_max=float(max_ms) if max_ms is not None else None,
        checkpoint_duration_ms_last=float(latest.ms) if latest is not None else None,
        last_restore_at=last_restore_at,
    )


async def quarantined(
    conn: AsyncConnection, run: str, after: tuple[int, int] | None, limit: int | None
) -> list[QuarantinedRecord]:
    """A run's quarantined records by (partition, offset), after ``after``."""
    await get_run(conn, run)
    table = quarantined_records.c
    query = select(quarantined_records).where(table.run == run)
    if after is not None:
        query = query.where(
            (table.partition > after[0])
            | ((table.partition == after[0]) & (table.offset > after[1]))
        )
    query = query.order_by(table.partition, table.offset).limit(limit)
    return [
        QuarantinedRecord(
            int(row.partition),
            int(row.offset),
            row.reason,
            int(row.size),
            bytes(row.first_bytes),
            float(row.recorded_at),
        )
        for row in await conn.execute(query)
    ]


# -- one episode across checkpoints and restores (analysts' episode history) ----------


async def episode_plan_entries(
    conn: AsyncConnection, run: str, episode: str
) -> list[tuple[int, RestoreEntry]]:
    """``(restore_id, entry)`` of every committed restore's plan that names ``episode``."""
    await get_run(conn, run)
    result = await conn.execute(
        select(
            restore_episodes.c.restore_id,
            restore_episodes.c.episode,
            restore_episodes.c.previous_attempt,
            restore_episodes.c.attempt,
            restore_episodes.c.action,
            restore_episodes.c.reason,
        )
        .where(restore_episodes.c.run == run, restore_episodes.c.episode == episode)
        .order_by(restore_episodes.c.restore_id)
    )
    return [(row[0], RestoreEntry(*row[1:])) for row in result]


async def episode_manifest_entries(
    conn: AsyncConnection, run: str, episode: str, partition: int
) -> list[tuple[int, ManifestEntry]]:
    """``(checkpoint_id, entry)`` of every kept committed manifest that names ``episode``: only
    the packed rows of the episode's partition in each manifest's chain are read."""
    await get_run(conn, run)
    rows = await conn.execute(
        select(manifest_chain.c.checkpoint_id, manifest_parts.c.entries)
        .join(manifest_parts, _CHAINED)
        .join(
            checkpoints,
            (checkpoints.c.run == manifest_chain.c.run)
            & (checkpoints.c.checkpoint_id == manifest_chain.c.checkpoint_id),
        )
        .where(
            manifest_chain.c.run == run,
            manifest_parts.c.cut_partition == partition,
            checkpoints.c.status == "committed",
        )
        .order_by(manifest_chain.c.checkpoint_id, manifest_chain.c.depth.desc())
    )
    newest: dict[int, list[Any]] = {}
    for checkpoint_id, body in rows:  # each chain oldest first: the newest entry stays
        for entry in orjson.loads(body):
            if entry[0] == episode:
                newest[checkpoint_id] = entry
                break
    kept = [(c, raw) for c, raw in newest.items() if raw[2] != REMOVED]
    return list(zip([c for c, _ in kept], entries_from_raw([raw for _, raw in kept]), strict=True))
