"""Who asked for a pending checkpoint, and whether it is still there to finish it (migration
0010). A checkpoint's requester is the replica that took the trainer's request: it writes the
markers, waits for every partition's part and answers. If that replica is gone — its heartbeat
lapsed (killed, paused past its lease, cut off from the catalog) or it restarted under the same
id (its ``replicas.started_at`` moved) — the trainer has lost its answer and will ask again,
through another replica; the run's next ``begin_checkpoint`` then aborts the orphan in its own
transaction (``supersede_orphan``) instead of refusing ``checkpoint_in_progress`` until the
orphan's deadline. The fence that keeps the orphan from committing afterwards is the one every
part write passes: its transaction locks the run and refuses a checkpoint no longer pending."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._leases import catalog_now
from rolloutlog.catalog._schema import checkpoints, replicas
from rolloutlog.catalog._writes import drop_checkpoint_parts

__all__ = ["requester_incarnation", "requester_gone", "supersede_orphan"]


async def requester_incarnation(conn: AsyncConnection, replica_id: str | None) -> float | None:
    """The requesting replica's ``started_at`` (which process of that id asks), or None."""
    if not replica_id:
        return None
    found = await conn.execute(
        select(replicas.c.started_at).where(replicas.c.replica_id == replica_id)
    )
    started_at = found.scalar_one_or_none()
    return None if started_at is None else float(started_at)


async def requester_gone(
    conn: AsyncConnection, clock: Callable[[], float], pending: Any
) -> str | None:
    """Why the pending checkpoint's requester can no longer finish it (its row's heartbeat
    expired by the catalog's clock, the row is gone, or it names a later process), or None
    while it may (also for a checkpoint that names no requester: no replica asked)."""
    replica_id = pending.requested_by
    if not replica_id:
        return None
    row = (
        await conn.execute(
            select(replicas.c.started_at, replicas.c.expires_at).where(
                replicas.c.replica_id == replica_id
            )
        )
    ).one_or_none()
    if row is None:
        return f"its requester {replica_id!r} is no replica any more"
    if pending.requester_started_at is not None and row.started_at != pending.requester_started_at:
        return f"its requester {replica_id!r} restarted"
    if row.expires_at <= await catalog_now(conn, clock):
        return f"the lease of its requester {replica_id!r} lapsed"
    return None


async def supersede_orphan(
    conn: AsyncConnection, run: str, checkpoint_id: int, reason: str, now: float
) -> None:
    """Abort an orphaned pending checkpoint (the caller holds the run's lock) and drop the
    parts its owners wrote: a part written after this is refused (not pending)."""
    await conn.execute(
        update(checkpoints)
        .where(
            checkpoints.c.run == run,
            checkpoints.c.checkpoint_id == checkpoint_id,
            checkpoints.c.status == "pending",
        )
        .values(status="aborted", ended_at=now, reason=reason)
    )
    await drop_checkpoint_parts(conn, run, checkpoint_id)
