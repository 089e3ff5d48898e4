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

from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._schema import checkpoints, replicas
from rolloutlog.catalog._writes import drop_checkpoint_parts, lock_run

__all__ = ["abort_orphans", "requester_gone", "requester_incarnation", "supersede_orphan"]


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
    conn: AsyncConnection, backend: Backend, clock: Callable[[], float], pending: Any
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
    if row.expires_at <= await backend.now(conn, clock):
        return f"the lease of its requester {replica_id!r} lapsed"
    return None


async def supersede_orphan(
    conn: AsyncConnection, run: str, checkpoint_id: int, reason: str, now: float
) -> bool:
    """Abort an orphaned pending checkpoint (the caller holds the run's lock: a part writer's
    transaction holds it too, so none is half-way) and drop the parts its owners wrote: a part
    written after this is refused (not pending). False if it was no longer pending."""
    found = await conn.execute(
        update(checkpoints)
        .where(
            checkpoints.c.run == run,
            checkpoints.c.checkpoint_id == checkpoint_id,
            checkpoints.c.status == "pending",
        )
        .values(status="aborted", ended_at=now, reason=reason)
        .returning(checkpoints.c.checkpoint_id)
    )
    if found.first() is None:
        return False
    await drop_checkpoint_parts(conn, run, checkpoint_id)
    return True


async def abort_orphans(
    conn: AsyncConnection,
    backend: Backend,
    clock: Callable[[], float],
    reason: str,
    *,
    requested_by: str | None,
) -> list[tuple[str, int]]:
    """Abort the pending checkpoints of ``requested_by``, or (None) every pending checkpoint
    whose requester is gone or unnamed: a live replica's is left to it (a replica starting must
    not abort the checkpoint another one is taking). Returns their (run, checkpoint id)."""
    rows = (
        await conn.execute(
            select(
                checkpoints.c.run,
                checkpoints.c.checkpoint_id,
                checkpoints.c.requested_by,
                checkpoints.c.requester_started_at,
            )
            .where(checkpoints.c.status == "pending")
            .order_by(checkpoints.c.run)
        )
    ).all()
    now = clock()
    aborted = []
    for row in rows:
        if requested_by is not None:
            if row.requested_by != requested_by:
                continue
        elif row.requested_by and await requester_gone(conn, backend, clock, row) is None:
            continue
        await lock_run(conn, row.run)  # not in the middle of a part writer's transaction
        if await supersede_orphan(conn, row.run, row.checkpoint_id, reason, now):
            aborted.append((str(row.run), int(row.checkpoint_id)))
    return aborted
