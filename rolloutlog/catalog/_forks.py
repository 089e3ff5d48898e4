"""Forks in the catalog: a run created as a branch of another run's committed checkpoint.

A fork is written in two transactions around the copy of its records into its own log
(``projections/_fork.py``): ``claim`` inserts the fork's ``runs`` row with ``forked_at`` NULL,
which claims the name while every other read skips the row (``RUN_VISIBLE``); ``commit`` then
writes, in one transaction, the fork's checkpoint 1 (committed, manifest-last, as any
checkpoint), its episodes at their attempts, its participants' epochs (seeded from the
source's, so that the fork's registrations start above the copied records' epochs) and
``forked_at``. A crash in between leaves a claimed row and nothing else: the same fork asked
again starts its copy afresh and commits; ``DELETE`` of the run removes the claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._checkpoint_commit import CheckpointParts, write_checkpoint_parts_rows
from rolloutlog.catalog._reads import run_from_row
from rolloutlog.catalog._schema import RUN_VISIBLE, checkpoints, episodes, participants, runs
from rolloutlog.catalog._values import ManifestEntry, PartitionOffset, Restore, Run
from rolloutlog.catalog._writes import delete_run_rows, lock_run
from rolloutlog.errors import InvalidRequest, RunExists, UnknownRun

__all__ = [
    "FORK_CHECKPOINT_ID",
    "FORK_RESTORE_ID",
    "ForkClaim",
    "claim",
    "commit",
    "forks_of",
    "inherited_restore",
    "release",
]

#: A fork's first checkpoint: its source's, restricted to the forked episodes.
FORK_CHECKPOINT_ID = 1
#: The restore id a fork's copied ``attempt.started`` records carry: restores that committed in
#: the source (restore ids start at 1, so no restore of the fork has it). Every fork counts it
#: as committed (``inherited_restore``).
FORK_RESTORE_ID = 0


def inherited_restore(run: Run) -> Restore | None:
    """For a fork, the restore its copied ``attempt.started`` records name (committed, with no
    episodes of its own in the catalog); None for a run that is no fork."""
    if run.forked_from_run is None:
        return None
    return Restore(
        run=run.run,
        restore_id=FORK_RESTORE_ID,
        checkpoint_id=FORK_CHECKPOINT_ID,
        controller_epoch=0,
        committed_at=run.forked_at or run.created_at,
        continue_count=0,
        restart_count=0,
        excluded_count=0,
    )


@dataclass(frozen=True, slots=True)
class ForkClaim:
    """What ``claim`` found: ``created`` (the fork exists whole already, with this request),
    else ``claimed`` (the name is the fork's, being created: a new claim, or the retry of one
    that did not finish)."""

    state: Literal["created", "claimed"]
    run: Run


def request_json(request: dict[str, Any]) -> str:
    """The fork's request as stored (``runs.fork_request``): keys sorted, so that the same
    request compares equal."""
    return orjson.dumps(request, option=orjson.OPT_SORT_KEYS).decode()


async def claim(
    conn: AsyncConnection,
    run: str,
    *,
    source: str,
    checkpoint_id: int,
    partitions: int,
    log_url: str | None,
    request: dict[str, Any],
    now: float,
) -> ForkClaim:
    """Claim ``run`` for a fork of ``source``'s checkpoint ``checkpoint_id`` (``RunExists`` if
    the name holds a run that is not this fork, or a fork asked differently)."""
    wanted = request_json(request)
    row = (
        await conn.execute(select(runs).where(runs.c.run == run).with_for_update())
    ).one_or_none()
    if row is not None:
        if row.forked_from_run is None or row.fork_request != wanted:
            raise RunExists(
                f"run {run!r} exists and is not this fork",
                run=run,
                settings={
                    "fork": {
                        "existing": orjson.loads(row.fork_request) if row.fork_request else None,
                        "requested": request,
                    }
                },
            )
        found = run_from_row(row)
        return ForkClaim("created" if row.forked_at is not None else "claimed", found)
    await conn.execute(
        insert(runs).values(
            run=run,
            partitions=partitions,
            log_url=log_url,
            created_at=now,
            forked_from_run=source,
            forked_from_checkpoint=checkpoint_id,
            fork_request=wanted,
        )
    )
    found = run_from_row((await conn.execute(select(runs).where(runs.c.run == run))).one())
    return ForkClaim("claimed", found)


async def commit(
    conn: AsyncConnection,
    backend: Backend,
    run: str,
    *,
    offsets: Sequence[PartitionOffset],
    entries: Sequence[ManifestEntry],
    first_offsets: dict[str, int],
    now: float,
    keep_committed: int,
) -> Run:
    """Create the claimed fork ``run`` whole: its checkpoint 1 with ``offsets`` and
    ``entries`` (cuts in the fork's own log), its episodes at their attempts (first seen at
    ``first_offsets``), its participants' epochs from the source's, and ``forked_at``."""
    await lock_run(conn, run)
    row = (await conn.execute(select(runs).where(runs.c.run == run))).one()
    if row.forked_from_run is None or row.forked_at is not None:
        raise InvalidRequest(f"run {run!r} is no fork being created", run=run)
    source = row.forked_from_run
    await conn.execute(
        update(runs).where(runs.c.run == run).values(last_checkpoint_id=FORK_CHECKPOINT_ID)
    )
    await conn.execute(
        insert(checkpoints).values(
            run=run,
            checkpoint_id=FORK_CHECKPOINT_ID,
            status="pending",
            trigger="fork",
            controller_epoch=0,
            requested_at=now,
        )
    )
    await write_checkpoint_parts_rows(
        conn,
        backend,
        CheckpointParts(run, FORK_CHECKPOINT_ID, offsets, entries, marked_at=now),
        now=now,
        keep_committed=keep_committed,
    )
    if entries:
        await conn.execute(
            insert(episodes),
            [
                {
                    "run": run,
                    "episode": entry.episode,
                    "current_attempt": entry.attempt,
                    "status": "running",
                    "first_partition": entry.cut_partition,
                    "first_offset": first_offsets.get(entry.episode),
                    "started_at": None,
                    "finished_at": None,
                    "updated_at": now,
                    "forked_attempt": entry.attempt,
                }
                for entry in entries
            ],
        )
    seeded = [
        {
            "run": run,
            "participant_id": p.participant_id,
            "kind": p.kind,
            "epoch": p.epoch,
            "registered_at": now,
            "last_seen_at": now,
        }
        for p in await conn.execute(
            select(participants.c.participant_id, participants.c.kind, participants.c.epoch).where(
                participants.c.run == source
            )
        )
    ]
    if seeded:
        await conn.execute(insert(participants), seeded)
    await conn.execute(update(runs).where(runs.c.run == run).values(forked_at=now))
    return run_from_row((await conn.execute(select(runs).where(runs.c.run == run))).one())


async def release(conn: AsyncConnection, run: str) -> bool:
    """Drop a claim whose fork was not created (False: there is none, or it was created)."""
    row = (
        await conn.execute(
            select(runs.c.forked_at)
            .where(runs.c.run == run, runs.c.forked_from_run.is_not(None))
            .with_for_update()
        )
    ).one_or_none()
    if row is None or row.forked_at is not None:
        return False
    await delete_run_rows(conn, run)
    return True


async def forks_of(conn: AsyncConnection, run: str) -> list[Run]:
    """The forks created from ``run``, oldest first (``UnknownRun`` for no such run)."""
    if (
        await conn.execute(select(runs.c.run).where(runs.c.run == run, RUN_VISIBLE))
    ).first() is None:
        raise UnknownRun(f"no run {run!r}", run=run)
    rows = await conn.execute(
        select(runs)
        .where(runs.c.forked_from_run == run, runs.c.forked_at.is_not(None))
        .order_by(runs.c.forked_at, runs.c.run)
    )
    return [run_from_row(row) for row in rows]
