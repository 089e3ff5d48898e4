"""Partition leases (issue 17): which service replica folds each partition of a run, fenced by a
generation number that grows at every change of owner. A write that speaks for a partition (a
checkpoint's manifest part, a restore's plan part) checks, in its own transaction, that its
writer still holds the partition at the generation it read: a replica that was paused while its
partitions moved on (a zombie) has its writes refused (``LeaseLost``).

Who owns what is decided by ``tick``, which every replica runs every ``lease_s / 4`` in one
serialized transaction: it renews the replica's heartbeat, takes the live replicas (by the
catalog's clock), and claims or releases the replica's partitions so that each partition moves
towards its desired owner (``desired_owner``: balanced, deterministic, the same on every
replica). A partition changes hands in two steps, each bumping its generation: its owner
releases it at its tick, the desired owner claims it at its own; an owner that died is skipped
(its partitions are claimed once its heartbeat expired)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._schema import partition_leases, replicas, runs
from rolloutlog.errors import LeaseLost

__all__ = [
    "PartitionOwner",
    "check_leases",
    "desired_owner",
    "partition_owners",
    "release_replica",
    "tick",
]

#: Owned partitions: run -> partition -> the lease generation it is held at.
Owned = dict[str, dict[int, int]]

#: The advisory lock key of lease changes on PostgreSQL (``_serialize``).
_TICK_LOCK_KEY = 0x726C6C_17

_RENEW = (
    "INSERT INTO replicas (replica_id, address, started_at, heartbeat_at, expires_at) "
    "VALUES (:replica_id, :address, :now, :now, :expires_at) "
    "ON CONFLICT (replica_id) DO UPDATE SET address = excluded.address, "
    "heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at"
)
#: A process's first tick: its row starts anew (an id reused by a restart).
_RENEW_FRESH = text(_RENEW + ", started_at = excluded.started_at")
_RENEW_AGAIN = text(_RENEW)


@dataclass(frozen=True, slots=True)
class PartitionOwner:
    """Who folds one partition of a run (``GET /v1/runs/{run}/projector``, operators)."""

    partition: int
    #: None while released, or before any replica claimed it.
    replica_id: str | None
    generation: int
    acquired_at: float | None
    #: Whether the owner's heartbeat is current (a dead owner's partitions are claimed soon).
    live: bool


def desired_owner(run: str, partition: int, live: Sequence[str]) -> str:
    """The replica that should fold ``partition`` of ``run``: round robin over the sorted live
    ids, offset per run by a stable hash of its name (so that runs' first partitions do not all
    land on the same replica). Balanced: a run's replicas differ by at most one partition."""
    return live[(zlib.crc32(run.encode()) + partition) % len(live)]


async def catalog_now(conn: AsyncConnection, clock: Callable[[], float]) -> float:
    """The lease clock: PostgreSQL's (one clock for every replica's heartbeat, whatever the
    hosts' skew), else ``clock`` (SQLite: every replica runs on the file's host)."""
    if conn.dialect.name == "postgresql":
        found = await conn.execute(text("SELECT extract(epoch FROM clock_timestamp())::float8"))
        return float(found.scalar_one())
    return clock()


async def tick(
    conn: AsyncConnection,
    clock: Callable[[], float],
    replica_id: str,
    *,
    address: str | None,
    lease_s: float,
    held: Mapping[str, Mapping[int, int]],
    fresh: bool,
) -> Owned:
    """One lease tick of ``replica_id`` (see the module); returns what it owns afterwards.

    ``held`` is what the replica's process believes it owns (what its previous tick returned):
    a row naming the replica at another generation was written by an earlier process under the
    same id (a restart), and is claimed again at the next generation, fencing that process's
    writes. ``fresh``: the process's first tick (its ``started_at`` is reset)."""
    await _serialize(conn)
    now = await catalog_now(conn, clock)
    await conn.execute(
        _RENEW_FRESH if fresh else _RENEW_AGAIN,
        {
            "replica_id": replica_id,
            "address": address,
            "now": now,
            "expires_at": now + lease_s,
        },
    )
    live = sorted(
        (await conn.execute(select(replicas.c.replica_id).where(replicas.c.expires_at > now)))
        .scalars()
        .all()
    )
    alive = set(live)
    leases = {
        (row.run, row.partition): (row.replica_id, int(row.generation))
        for row in await conn.execute(
            select(
                partition_leases.c.run,
                partition_leases.c.partition,
                partition_leases.c.replica_id,
                partition_leases.c.generation,
            )
        )
    }
    owned: Owned = {}
    new: list[dict[str, object]] = []
    changed: list[dict[str, object]] = []
    for row in await conn.execute(select(runs.c.run, runs.c.partitions)):
        run, mine = row.run, held.get(row.run, {})
        for partition in range(row.partitions):
            desired = desired_owner(run, partition, live)
            found = leases.get((run, partition))
            if found is None:
                if desired == replica_id:
                    new.append({"run": run, "partition": partition, "generation": 1})
                    owned.setdefault(run, {})[partition] = 1
                continue
            owner, generation = found
            if desired != replica_id:
                if owner == replica_id:  # another live replica should have it: let go
                    changed.append(_change(run, partition, None, generation + 1))
                continue
            if owner == replica_id and mine.get(partition) == generation:
                owned.setdefault(run, {})[partition] = generation  # still mine
            elif owner is None or owner == replica_id or owner not in alive:
                changed.append(_change(run, partition, replica_id, generation + 1))
                owned.setdefault(run, {})[partition] = generation + 1
            # else: a live replica still holds it; it lets go at its own tick
    if new:
        await conn.execute(
            insert(partition_leases).values(replica_id=replica_id, acquired_at=now), new
        )
    if changed:
        await conn.execute(
            update(partition_leases)
            .where(
                partition_leases.c.run == bindparam("b_run"),
                partition_leases.c.partition == bindparam("b_partition"),
            )
            .values(
                replica_id=bindparam("b_owner"),
                generation=bindparam("b_generation"),
                acquired_at=now,
            ),
            changed,
        )
    return owned


async def _serialize(conn: AsyncConnection) -> None:
    """Lease changes one at a time: PostgreSQL's transaction-scoped advisory lock (SQLite's
    writes are serialized already), so two ticks never decide on the same snapshot."""
    if conn.dialect.name == "postgresql":
        await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _TICK_LOCK_KEY})


def _change(run: str, partition: int, owner: str | None, generation: int) -> dict[str, object]:
    return {"b_run": run, "b_partition": partition, "b_owner": owner, "b_generation": generation}


async def release_replica(
    conn: AsyncConnection, clock: Callable[[], float], replica_id: str
) -> None:
    """A replica stops: its partitions are released (next generation) and its heartbeat ends
    now, so the others claim them at their next tick instead of after the lease time."""
    await _serialize(conn)
    now = await catalog_now(conn, clock)
    await conn.execute(
        update(partition_leases)
        .where(partition_leases.c.replica_id == replica_id)
        .values(replica_id=None, generation=partition_leases.c.generation + 1, acquired_at=now)
    )
    await conn.execute(
        update(replicas)
        .where(replicas.c.replica_id == replica_id, replicas.c.expires_at > now)
        .values(expires_at=now)
    )


async def partition_owners(
    conn: AsyncConnection, clock: Callable[[], float], run: str, partitions: int
) -> list[PartitionOwner]:
    """Every partition of ``run`` with its lease (none yet: no owner, generation 0)."""
    now = await catalog_now(conn, clock)
    query = (
        select(
            partition_leases.c.partition,
            partition_leases.c.replica_id,
            partition_leases.c.generation,
            partition_leases.c.acquired_at,
            replicas.c.expires_at,
        )
        .select_from(partition_leases)
        .outerjoin(replicas, replicas.c.replica_id == partition_leases.c.replica_id)
        .where(partition_leases.c.run == run)
    )
    found = {row.partition: row for row in await conn.execute(query)}
    out = []
    for partition in range(partitions):
        row = found.get(partition)
        if row is None:
            out.append(PartitionOwner(partition, None, 0, None, False))
            continue
        live = row.expires_at is not None and row.expires_at > now
        out.append(
            PartitionOwner(partition, row.replica_id, int(row.generation), row.acquired_at, live)
        )
    return out


async def check_leases(
    conn: AsyncConnection, run: str, replica_id: str, generations: Mapping[int, int]
) -> None:
    """``LeaseLost`` unless ``replica_id`` holds every partition of ``generations`` at exactly
    that generation. Locks the lease rows (PostgreSQL) until the transaction ends, so an owner
    change waits for the write it would fence."""
    if not generations:
        return
    table = partition_leases
    query = (
        select(table.c.partition, table.c.replica_id, table.c.generation)
        .where(table.c.run == run, table.c.partition.in_(list(generations)))
        .with_for_update()
    )
    held = {row.partition: (row.replica_id, row.generation) for row in await conn.execute(query)}
    for partition, generation in sorted(generations.items()):
        owner = held.get(partition)
        if owner != (replica_id, generation):
            now = "nobody" if owner is None or owner[0] is None else f"{owner[0]} at {owner[1]}"
            raise LeaseLost(
                f"replica {replica_id!r} no longer owns partition {partition} of run {run!r} "
                f"at generation {generation} (held by {now})",
                run=run,
                partition=partition,
            )
