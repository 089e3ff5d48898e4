"""Partition leases: which service replica folds each partition of a run, fenced by a
generation number that grows at every change of owner. A write that speaks for a partition (a
checkpoint's manifest part, a restore's plan part) checks, in its own transaction, that its
writer still holds the partition at the generation it read: a replica that was paused while its
partitions moved on (a zombie) has its writes refused (``LeaseLost``).

Who owns what is decided by ``tick``, which every replica's heartbeat runs every ``lease_s / 4`` in
one serialized transaction: it renews the replica's heartbeat (and writes its health report), takes
the live replicas (by the catalog's clock), and claims or releases the replica's partitions so that
each run's partitions move towards ``assign_partitions``: balanced within one partition, sticky (a
partition stays with its live owner unless balance needs it elsewhere), deterministic (the same
on every replica, from the same rows). A partition changes hands in two steps, each bumping its
generation: its owner releases it at its tick, the new owner claims it at its own; an owner that
died is skipped (its partitions are claimed once its heartbeat expired)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._schema import RUN_VISIBLE, partition_leases, replicas, runs
from rolloutlog.errors import LeaseLost

__all__ = [
    "ClusterView",
    "PartitionOwner",
    "ReplicaReport",
    "assign_partitions",
    "check_leases",
    "cluster_view",
    "partition_owners",
    "release_replica",
    "tick",
]

#: Owned partitions: run -> partition -> the lease generation it is held at.
Owned = dict[str, dict[int, int]]

#: How long after its lease ran out a replica still owning partitions is read with its report.
_REPORTS_KEPT_S = 86_400.0

_RENEW = (
    "INSERT INTO replicas (replica_id, address, started_at, heartbeat_at, expires_at, health) "
    "VALUES (:replica_id, :address, :now, :now, :expires_at, :health) "
    "ON CONFLICT (replica_id) DO UPDATE SET address = excluded.address, "
    "heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at, "
    "health = excluded.health"
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


def assign_partitions(
    run: str, partitions: int, owners: Mapping[int, str | None], live: Sequence[str]
) -> dict[int, str]:
    """Which live replica should fold each of ``run``'s ``partitions``, given their current
    ``owners`` (a partition absent, released or held by a replica not in ``live`` is free).

    Balanced: every replica gets ``partitions // len(live)`` or one more. Sticky: each live owner
    keeps its lowest-numbered partitions up to its quota, so a membership change moves only what
    balance needs (a departed replica's partitions, and a newcomer's share taken from those above
    quota). The one-more slots go first to replicas holding more than the base (that keeps moves
    minimal), then in the run's rotation of the sorted ids (a stable hash of the run's name, so
    that the runs' extra partitions spread over the replicas). Free partitions fill the replicas
    short of their quota in that rotation, in contiguous blocks of the sorted free ones. Stable
    through a handover: releasing a partition that is to move, or claiming one that is to come,
    leaves the result unchanged, so a change of hands never redirects itself midway."""
    if not live:
        return {}
    ids = sorted(set(live))
    shift = zlib.crc32(run.encode()) % len(ids)
    rotation = ids[shift:] + ids[:shift]
    base, extra = divmod(partitions, len(ids))
    held: dict[str, list[int]] = {replica: [] for replica in rotation}
    for partition in range(partitions):
        owner = owners.get(partition)
        if owner in held:
            held[owner].append(partition)
    ranked = [r for r in rotation if len(held[r]) > base] + [
        r for r in rotation if len(held[r]) <= base
    ]
    quota = {replica: base + (rank < extra) for rank, replica in enumerate(ranked)}
    assigned: dict[int, str] = {}
    for replica in rotation:
        for partition in held[replica][: quota[replica]]:
            assigned[partition] = replica
    free = iter(p for p in range(partitions) if p not in assigned)
    for replica in rotation:
        for _ in range(quota[replica] - min(len(held[replica]), quota[replica])):
            assigned[next(free)] = replica
    return assigned


async def tick(
    conn: AsyncConnection,
    backend: Backend,
    clock: Callable[[], float],
    replica_id: str,
    *,
    address: str | None,
    lease_s: float,
    held: Mapping[str, Mapping[int, int]],
    fresh: bool,
    health: str | None = None,
) -> Owned:
    """One lease tick of ``replica_id`` (see the module); returns what it owns afterwards.

    ``held`` is what the replica's process believes it owns (what its previous tick returned):
    a row naming the replica at another generation was written by an earlier process under the
    same id (a restart), and is claimed again at the next generation, fencing that process's
    writes. ``fresh``: the process's first tick (its ``started_at`` is reset). ``health``: the
    replica's report of its projectors (JSON, read by ``replica_reports``)."""
    await backend.serialize_lease_changes(conn)
    now = await backend.now(conn, clock)
    await conn.execute(
        _RENEW_FRESH if fresh else _RENEW_AGAIN,
        {
            "replica_id": replica_id,
            "address": address,
            "now": now,
            "expires_at": now + lease_s,
            "health": health,
        },
    )
    live = sorted(
        (await conn.execute(select(replicas.c.replica_id).where(replicas.c.expires_at > now)))
        .scalars()
        .all()
    )
    alive = set(live)
    leases: dict[str, dict[int, tuple[str | None, int]]] = {}
    for lease in await conn.execute(
        select(
            partition_leases.c.run,
            partition_leases.c.partition,
            partition_leases.c.replica_id,
            partition_leases.c.generation,
        )
    ):
        leases.setdefault(lease.run, {})[lease.partition] = (
            lease.replica_id,
            int(lease.generation),
        )
    owned: Owned = {}
    new: list[dict[str, object]] = []
    changed: list[dict[str, object]] = []
    for row in await conn.execute(select(runs.c.run, runs.c.partitions).where(RUN_VISIBLE)):
        run, mine = row.run, held.get(row.run, {})
        run_leases = leases.get(run, {})
        current = {partition: owner for partition, (owner, _) in run_leases.items()}
        assignment = assign_partitions(run, row.partitions, current, live)
        for partition in range(row.partitions):
            desired = assignment[partition]
            found = run_leases.get(partition)
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


def _change(run: str, partition: int, owner: str | None, generation: int) -> dict[str, object]:
    return {"b_run": run, "b_partition": partition, "b_owner": owner, "b_generation": generation}


async def release_replica(
    conn: AsyncConnection, backend: Backend, clock: Callable[[], float], replica_id: str
) -> None:
    """A replica stops: its partitions are released (next generation) and its heartbeat ends
    now, so the others claim them at their next tick instead of after the lease time."""
    await backend.serialize_lease_changes(conn)
    now = await backend.now(conn, clock)
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
    conn: AsyncConnection,
    backend: Backend,
    clock: Callable[[], float],
    run: str,
    partitions: int,
) -> list[PartitionOwner]:
    """Every partition of ``run`` with its lease (none yet: no owner, generation 0)."""
    now = await backend.now(conn, clock)
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


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica as its last heartbeat left it in the catalog."""

    replica_id: str
    address: str | None
    live: bool
    #: Seconds since its last heartbeat, by the catalog's clock.
    silent_s: float
    #: Its report of its projectors (see ``projections._health``), or None if it wrote none.
    health: Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What every replica can read of who folds what and how it goes (``cluster_view``)."""

    #: Per run: its partition count, and each leased partition's (owner, generation).
    partitions: Mapping[str, int]
    leases: Mapping[str, Mapping[int, tuple[str | None, int]]]
    #: The replicas that are live or own a partition, by id.
    replicas: Mapping[str, ReplicaReport]


async def cluster_view(
    conn: AsyncConnection, backend: Backend, clock: Callable[[], float], run: str | None = None
) -> ClusterView:
    """The leases of ``run`` (every run: None) with their owners' heartbeats and reports."""
    now = await backend.now(conn, clock)
    run_query = select(runs.c.run, runs.c.partitions).where(RUN_VISIBLE)
    lease_query = select(
        partition_leases.c.run,
        partition_leases.c.partition,
        partition_leases.c.replica_id,
        partition_leases.c.generation,
    )
    if run is not None:
        run_query = run_query.where(runs.c.run == run)
        lease_query = lease_query.where(partition_leases.c.run == run)
    counts = {row.run: int(row.partitions) for row in await conn.execute(run_query)}
    leases: dict[str, dict[int, tuple[str | None, int]]] = {}
    owners: set[str] = set()
    for lease in await conn.execute(lease_query):
        leases.setdefault(lease.run, {})[lease.partition] = (
            lease.replica_id,
            int(lease.generation),
        )
        if lease.replica_id is not None:
            owners.add(lease.replica_id)
    found: dict[str, ReplicaReport] = {}
    for row in await conn.execute(
        select(
            replicas.c.replica_id,
            replicas.c.address,
            replicas.c.heartbeat_at,
            replicas.c.expires_at,
            replicas.c.health,
        ).where(replicas.c.expires_at > now - _REPORTS_KEPT_S)
    ):
        if row.replica_id not in owners and row.expires_at <= now:
            continue
        try:
            health = orjson.loads(row.health) if row.health else None
        except orjson.JSONDecodeError:
            health = None
        found[row.replica_id] = ReplicaReport(
            row.replica_id,
            row.address,
            row.expires_at > now,
            max(0.0, now - row.heartbeat_at),
            health if isinstance(health, dict) else None,
        )
    return ClusterView(counts, leases, found)
