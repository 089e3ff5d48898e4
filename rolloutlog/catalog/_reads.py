"""Read queries: each takes a connection inside one read transaction (one snapshot)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from sqlalchemy import Row, Select, Table, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._schema import (
    RUN_VISIBLE,
    checkpoint_offsets,
    checkpoint_parts,
    checkpoints,
    episodes,
    participants,
    quarantined_records,
    restore_episodes,
    restores,
    runs,
)
from rolloutlog.catalog._values import (
    Checkpoint,
    CheckpointStatus,
    Episode,
    EpisodeStatus,
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


def encode_json_map(values: Mapping[str, float]) -> str | None:
    """A stored ``timings_ms`` (NULL when empty); ``decode_json_map`` reads it back."""
    return orjson.dumps(values).decode() if values else None


def decode_json_map(raw: str | None) -> dict[str, float]:
    return cast(dict[str, float], orjson.loads(raw)) if raw else {}


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

V = TypeVar("V", bound="DataclassInstance")


def value_from_row(cls: type[V], row: Row[Any], **given: Any) -> V:
    """A value of the dataclass ``cls`` from the row's columns of its fields' names, ``given``
    the others (a field neither names keeps its default)."""
    columns = row._mapping
    values = {name: columns[name] for name in _field_names(cls) if name in columns}
    values.update(given)
    return cls(**values)


@functools.cache
def _field_names(cls: type[DataclassInstance]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def run_from_row(row: Row[Any]) -> Run:
    return value_from_row(Run, row)


def checkpoint_from_row(row: Row[Any], offsets: Sequence[PartitionOffset]) -> Checkpoint:
    return value_from_row(
        Checkpoint, row, timings_ms=decode_json_map(row.timings_ms), offsets=tuple(offsets)
    )


def restore_from_row(row: Row[Any]) -> Restore:
    return value_from_row(Restore, row, timings_ms=decode_json_map(row.timings_ms))


def episode_from_row(row: Row[Any]) -> Episode:
    return value_from_row(Episode, row)


async def get_run(conn: AsyncConnection, run: str) -> Run:
    query = select(runs).where(runs.c.run == run, RUN_VISIBLE)
    row = (await conn.execute(query)).one_or_none()
    if row is None:
        raise UnknownRun(f"no run {run!r}", run=run)
    return run_from_row(row)


async def list_runs(
    conn: AsyncConnection,
    after: str | None,
    limit: int,
    keep: Callable[[str], bool] | None = None,
) -> list[RunSummary]:
    """Up to ``limit`` runs after ``after`` by name, only those ``keep`` keeps (read on page by
    page until as many are kept or the runs end); only the kept ones are counted."""
    found: list[Run] = []
    while len(found) < limit:
        query = select(runs).where(RUN_VISIBLE).order_by(runs.c.run).limit(limit)
        if after is not None:
            query = query.where(runs.c.run > after)
        page = [run_from_row(row) for row in await conn.execute(query)]
        found += page if keep is None else [run for run in page if keep(run.run)]
        if len(page) < limit:
            break
        after = page[-1].run
    return await summarize_runs(conn, found[:limit])


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


async def checkpoint_status(conn: AsyncConnection, run: str, checkpoint_id: int) -> str | None:
    """The checkpoint's status, or None when the run has no such checkpoint."""
    status = (
        await conn.execute(
            select(checkpoints.c.status).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).scalar_one_or_none()
    return None if status is None else str(status)


def _newest_first(table: Table, key: Any, run: str, before: int | None, limit: int) -> Select[Any]:
    """A page of the run's rows of ``table``, newest ``key`` first, below ``before``."""
    query = select(table).where(table.c.run == run).order_by(key.desc()).limit(limit)
    return query if before is None else query.where(key < before)


async def _row_of_run(
    conn: AsyncConnection, run: str, query: Select[Any], missing: Callable[[], Exception]
) -> Row[Any]:
    """The one row ``query`` finds of ``run``, else ``UnknownRun`` or (the run is there)
    ``missing()``."""
    row: Row[Any] | None = (await conn.execute(query)).one_or_none()
    if row is None:
        await get_run(conn, run)
        raise missing()
    return row


async def checkpoint_row(conn: AsyncConnection, run: str, checkpoint_id: int) -> Row[Any]:
    """The checkpoint's ``checkpoints`` row (``UnknownRun``, ``UnknownCheckpoint``)."""
    return await _row_of_run(
        conn,
        run,
        select(checkpoints).where(
            checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
        ),
        lambda: UnknownCheckpoint(
            f"run {run!r} has no checkpoint {checkpoint_id}", run=run, checkpoint_id=checkpoint_id
        ),
    )


async def get_checkpoint(conn: AsyncConnection, run: str, checkpoint_id: int) -> Checkpoint:
    row = await checkpoint_row(conn, run, checkpoint_id)
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
    query = _newest_first(checkpoints, checkpoints.c.checkpoint_id, run, before, limit)
    if status is not None:
        query = query.where(checkpoints.c.status == status)
    if request_id is not None:
        query = query.where(checkpoints.c.request_id == request_id)
    rows = (await conn.execute(query)).all()
    offsets = await offsets_of(conn, run, [row.checkpoint_id for row in rows])
    return [checkpoint_from_row(row, offsets[row.checkpoint_id]) for row in rows]


async def get_restore(conn: AsyncConnection, run: str, restore_id: int) -> Restore:
    row = await _row_of_run(
        conn,
        run,
        select(restores).where(restores.c.run == run, restores.c.restore_id == restore_id),
        lambda: UnknownRestore(
            f"run {run!r} has no restore {restore_id}", run=run, restore_id=restore_id
        ),
    )
    return restore_from_row(row)


async def list_restores(
    conn: AsyncConnection, run: str, before: int | None, limit: int
) -> list[Restore]:
    await get_run(conn, run)
    query = _newest_first(restores, restores.c.restore_id, run, before, limit)
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
    row = await _row_of_run(
        conn,
        run,
        select(episodes).where(episodes.c.run == run, episodes.c.episode == episode),
        lambda: UnknownEpisode(f"run {run!r} has no episode {episode!r}", run=run, episode=episode),
    )
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


# -- one episode across restores (analysts' episode history; its manifests: ``_manifests.py``)


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
