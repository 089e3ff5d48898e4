"""Partition leases (issue 17): which service replica folds each partition of a run, fenced by a
generation number that grows at every change of owner. A write that speaks for a partition (a
checkpoint's manifest part, a restore's plan part) checks, in its own transaction, that its
writer still holds the partition at the generation it read: a replica that was paused while its
partitions moved on (a zombie) has its writes refused (``LeaseLost``)."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._schema import partition_leases
from rolloutlog.errors import LeaseLost

__all__ = ["check_leases"]


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
