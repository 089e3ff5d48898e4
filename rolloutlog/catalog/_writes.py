"""The run-row lock every fencing write takes first, retention, and the small writes beside the
two commits (``_checkpoint_commit.py``, ``_restore_commit.py``): opening a checkpoint, dropping
an aborted checkpoint's parts, quarantined records, a run's deletion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, insert, select, text, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _reads
from rolloutlog.catalog._schema import (
    checkpoint_offsets,
    checkpoint_parts,
    checkpoints,
    episodes,
    manifest_chain,
    manifest_parts,
    participants,
    partition_leases,
    quarantined_records,
    restore_episodes,
    restore_parts,
    restore_requests,
    restores,
    results,
    runs,
)
from rolloutlog.catalog._values import QUARANTINE_FIRST_BYTES, QuarantinedRecord
from rolloutlog.core import check_controller_epoch
from rolloutlog.errors import CheckpointNotPending, UnknownRun

# ``offset`` is an SQL keyword: quoted.
_QUARANTINE = text(
    'INSERT INTO quarantined_records (run, partition, "offset", reason, size, first_bytes, '
    "recorded_at) VALUES (:run, :partition, :offset, :reason, :size, :first_bytes, :recorded_at) "
    'ON CONFLICT (run, partition, "offset") DO NOTHING'
)


async def lock_run(conn: AsyncConnection, run: str, controller_epoch: int | None = None) -> Any:
    """Lock the run's row for this transaction; check the controller epoch when given.

    On PostgreSQL ``FOR NO KEY UPDATE`` queues concurrent fencing writes of the same run without
    blocking inserts that only reference the run; SQLite's ``BEGIN IMMEDIATE`` already serializes.
    """
    row = (
        await conn.execute(
            select(
                runs.c.partitions,
                runs.c.controller_epoch,
                runs.c.last_checkpoint_id,
                runs.c.last_restore_id,
            )
            .where(runs.c.run == run)
            .with_for_update(key_share=True)
        )
    ).one_or_none()
    if row is None:
        raise UnknownRun(f"no run {run!r}", run=run)
    if controller_epoch is not None:
        check_controller_epoch(run, controller_epoch, int(row.controller_epoch))
    return row


async def open_checkpoint(
    conn: AsyncConnection, run: str, checkpoint_id: int, **values: Any
) -> None:
    """Make ``checkpoint_id`` the run's last checkpoint and insert its row, pending, with
    ``values`` (``trigger``, ``controller_epoch``, ``requested_at``...)."""
    await conn.execute(
        update(runs).where(runs.c.run == run).values(last_checkpoint_id=checkpoint_id)
    )
    await conn.execute(
        insert(checkpoints).values(run=run, checkpoint_id=checkpoint_id, status="pending", **values)
    )


async def pending_checkpoint(conn: AsyncConnection, run: str, checkpoint_id: int) -> Any:
    """The checkpoint's row, which must be pending (``CheckpointNotPending``)."""
    row = await _reads.checkpoint_row(conn, run, checkpoint_id)
    if row.status != "pending":
        raise CheckpointNotPending(
            f"checkpoint {checkpoint_id} of run {run!r} is {row.status}, not pending",
            run=run,
            checkpoint_id=checkpoint_id,
            status=row.status,
        )
    return row


async def drop_checkpoint_parts(conn: AsyncConnection, run: str, checkpoint_id: int) -> None:
    """Delete what writers stored for a checkpoint that will never commit (it is aborted)."""
    for table, column in (
        (manifest_parts, manifest_parts.c.checkpoint_id),
        (checkpoint_offsets, checkpoint_offsets.c.checkpoint_id),
        (checkpoint_parts, checkpoint_parts.c.checkpoint_id),
    ):
        await conn.execute(delete(table).where(table.c.run == run, column == checkpoint_id))


async def apply_retention(conn: AsyncConnection, run: str, keep: int, now: float) -> None:
    """Expire committed checkpoints beyond the newest ``keep``; delete the packed parts no
    retained checkpoint's chains name any more (an expired checkpoint's part a retained delta
    part amends stays until a whole part of its partition is written after it)."""
    expired = (
        (
            await conn.execute(
                select(checkpoints.c.checkpoint_id)
                .where(checkpoints.c.run == run, checkpoints.c.status == "committed")
                .order_by(checkpoints.c.checkpoint_id.desc())
                .offset(keep)
            )
        )
        .scalars()
        .all()
    )
    if not expired:
        return
    await conn.execute(
        update(checkpoints)
        .where(checkpoints.c.run == run, checkpoints.c.checkpoint_id.in_(expired))
        .values(status="expired", ended_at=now)
    )
    await conn.execute(
        delete(manifest_chain).where(
            manifest_chain.c.run == run, manifest_chain.c.checkpoint_id.in_(expired)
        )
    )
    await _drop_unchained_parts(conn, run)


async def _drop_unchained_parts(conn: AsyncConnection, run: str) -> None:
    named = select(manifest_chain.c.ancestor_id, manifest_chain.c.partition).where(
        manifest_chain.c.run == run
    )
    await conn.execute(
        delete(manifest_parts).where(
            manifest_parts.c.run == run,
            tuple_(manifest_parts.c.checkpoint_id, manifest_parts.c.cut_partition).not_in(named),
        )
    )


async def quarantine_rows(
    conn: AsyncConnection, run: str, records: Sequence[QuarantinedRecord], now: float
) -> None:
    """Insert quarantined records; one already recorded (a restarted projector finds it again)
    keeps its first row."""
    rows = [
        {
            "run": run,
            "partition": record.partition,
            "offset": record.offset,
            # PostgreSQL's text cannot hold NUL.
            "reason": record.reason[:2000].replace("\x00", "\\x00"),
            "size": record.size,
            "first_bytes": bytes(record.first_bytes[:QUARANTINE_FIRST_BYTES]),
            "recorded_at": now,
        }
        for record in records
    ]
    await conn.execute(_QUARANTINE, rows)


# -- run deletion (helper ``embedded``) --------------------------------------------------------

#: Tables holding a run's rows, children before the tables they reference.
_RUN_TABLES = (
    restore_parts,
    restore_requests,
    checkpoint_parts,
    partition_leases,
    results,
    quarantined_records,
    restore_episodes,
    restores,
    manifest_chain,
    manifest_parts,
    checkpoint_offsets,
    checkpoints,
    episodes,
    participants,
)


async def delete_run_rows(conn: AsyncConnection, run: str) -> None:
    """Delete every row of ``run`` (``UnknownRun`` if it has none), the run's own row last."""
    await lock_run(conn, run)
    for table in _RUN_TABLES:
        await conn.execute(delete(table).where(table.c.run == run))
    await conn.execute(delete(runs).where(runs.c.run == run))
