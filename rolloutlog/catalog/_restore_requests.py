"""Restores planned per partition owner (docs/design.md §10 "A restore"): the request a
replica opens, each owner's part of the plan (fenced by its partition leases), and how the request
ends (committed with the restore, or aborted). Functions of an open transaction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._leases import check_leases
from rolloutlog.catalog._restore_commit import reserve_restore_id
from rolloutlog.catalog._schema import restore_parts, restore_requests
from rolloutlog.catalog._writes import lock_run
from rolloutlog.errors import RestoreConflict, UnknownRestore

__all__ = [
    "RestorePart",
    "RestorePlanning",
    "abort_expired",
    "abort_request",
    "check_planning",
    "end_request",
    "get_request",
    "lock_for_commit",
    "open_request",
    "planning_requests",
    "read_parts",
    "write_parts",
]


@dataclass(frozen=True, slots=True)
class RestorePlanning:
    """A restore being planned by the partitions' owners (or how it ended)."""

    run: str
    restore_id: int
    checkpoint_id: int
    controller_epoch: int
    requested_by: str
    status: str  # planning | committed | aborted
    #: What the owners plan by: ``exclude``, ``exclude_results``, ``policy_version``,
    #: ``max_policy_lag``.
    request: Mapping[str, Any]
    requested_at: float
    deadline_at: float
    ended_at: float | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class RestorePart:
    """One partition's part of a restore plan, and who wrote it at which lease generation (0:
    not fenced)."""

    partition: int
    replica_id: str
    generation: int
    #: The part as its owner encoded it (JSON-decoded).
    body: Any


def _request(row: Any) -> RestorePlanning:
    return RestorePlanning(
        row.run,
        int(row.restore_id),
        int(row.checkpoint_id),
        int(row.controller_epoch),
        row.requested_by,
        row.status,
        orjson.loads(row.request),
        float(row.requested_at),
        float(row.deadline_at),
        row.ended_at,
        row.reason,
    )


async def open_request(
    conn: AsyncConnection,
    *,
    run: str,
    controller_epoch: int,
    checkpoint_id: int,
    requested_by: str,
    request: Mapping[str, Any],
    now: float,
    deadline_at: float,
) -> int:
    """Reserve the run's next restore id (``reserve_restore_id``) and open its request."""
    restore_id = await reserve_restore_id(conn, run, controller_epoch)
    await conn.execute(
        insert(restore_requests).values(
            run=run,
            restore_id=restore_id,
            checkpoint_id=checkpoint_id,
            controller_epoch=controller_epoch,
            requested_by=requested_by,
            status="planning",
            request=orjson.dumps(dict(request)).decode(),
            requested_at=now,
            deadline_at=deadline_at,
        )
    )
    return restore_id


async def check_planning(conn: AsyncConnection, run: str, restore_id: int) -> None:
    """Lock the request's row; ``RestoreConflict`` unless it is still planning."""
    table = restore_requests
    row = (
        await conn.execute(
            select(table.c.status, table.c.reason)
            .where(table.c.run == run, table.c.restore_id == restore_id)
            .with_for_update()
        )
    ).one_or_none()
    if row is None:
        raise UnknownRestore(f"no restore request {restore_id} of run {run!r}", run=run)
    if row.status != "planning":
        raise RestoreConflict(
            f"restore {restore_id} of run {run!r} is {row.status}"
            + (f" ({row.reason})" if row.reason else "")
            + ", no longer planning",
            run=run,
            restore_id=restore_id,
            status=row.status,
        )


async def write_parts(
    conn: AsyncConnection,
    *,
    run: str,
    restore_id: int,
    replica_id: str,
    generations: Mapping[int, int],
    bodies: Mapping[int, Any],
    now: float,
) -> None:
    """Store an owner's part per partition of a planning request, fenced by its leases (a
    partition without a generation is not fenced: stored at generation 0)."""
    await check_planning(conn, run, restore_id)
    await check_leases(conn, run, replica_id, {p: g for p, g in generations.items() if p in bodies})
    await conn.execute(
        insert(restore_parts),
        [
            {
                "run": run,
                "restore_id": restore_id,
                "partition": partition,
                "replica_id": replica_id,
                "generation": generations.get(partition, 0),
                "written_at": now,
                "entries": orjson.dumps(body).decode(),
            }
            for partition, body in sorted(bodies.items())
        ],
    )


async def read_parts(conn: AsyncConnection, run: str, restore_id: int) -> list[RestorePart]:
    table = restore_parts
    rows = await conn.execute(
        select(table.c.partition, table.c.replica_id, table.c.generation, table.c.entries)
        .where(table.c.run == run, table.c.restore_id == restore_id)
        .order_by(table.c.partition)
    )
    return [
        RestorePart(int(r.partition), r.replica_id, int(r.generation), orjson.loads(r.entries))
        for r in rows
    ]


async def planning_requests(conn: AsyncConnection, run: str | None) -> list[RestorePlanning]:
    """Every request still planning (of one run, or of all)."""
    query = select(restore_requests).where(restore_requests.c.status == "planning")
    if run is not None:
        query = query.where(restore_requests.c.run == run)
    return [_request(row) for row in await conn.execute(query)]


async def get_request(conn: AsyncConnection, run: str, restore_id: int) -> RestorePlanning:
    table = restore_requests
    row = (
        await conn.execute(
            select(table).where(table.c.run == run, table.c.restore_id == restore_id)
        )
    ).one_or_none()
    if row is None:
        raise UnknownRestore(f"no restore request {restore_id} of run {run!r}", run=run)
    return _request(row)


async def end_request(
    conn: AsyncConnection, run: str, restore_id: int, status: str, now: float, reason: str | None
) -> bool:
    """Move a planning request to ``status``; False when it was not planning any more."""
    table = restore_requests
    done = await conn.execute(
        update(table)
        .where(table.c.run == run, table.c.restore_id == restore_id, table.c.status == "planning")
        .values(status=status, ended_at=now, reason=reason)
    )
    return bool(done.rowcount)


async def abort_request(
    conn: AsyncConnection, run: str, restore_id: int, now: float, reason: str
) -> bool:
    """Abort a request still planning (its reserved id stays unused); False if it was not."""
    return await end_request(conn, run, restore_id, "aborted", now, reason)


async def abort_expired(conn: AsyncConnection, now: float) -> int:
    """Abort every request still planning past its deadline; how many."""
    table = restore_requests
    done = await conn.execute(
        update(table)
        .where(table.c.status == "planning", table.c.deadline_at < now)
        .values(status="aborted", ended_at=now, reason="not planned by its deadline")
    )
    return int(done.rowcount or 0)


async def lock_for_commit(
    conn: AsyncConnection, run: str, restore_id: int, fences: Mapping[str, Mapping[int, int]]
) -> None:
    """In a restore's commit: its request still planning, every part's writer still holding its
    partitions at the generations it planned them at."""
    await lock_run(conn, run)
    await check_planning(conn, run, restore_id)
    for replica_id, generations in sorted(fences.items()):
        await check_leases(conn, run, replica_id, generations)
