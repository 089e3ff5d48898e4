"""Forks in the catalog: a run created as a branch of another run's committed checkpoint.

A fork is written in two transactions around the copy of its records into its own log
(``projections/_fork.py``): ``claim`` inserts the fork's ``runs`` row with ``forked_at`` NULL,
which claims the name while every other read skips the row (``RUN_VISIBLE``); ``commit`` then
writes, in one transaction, the fork's checkpoint 1 (committed, manifest-last, as any
checkpoint), its episodes at their attempts, its participants' epochs (seeded from the
source's, so that the fork's registrations start above the copied records' epochs) and
``forked_at``. A crash in between leaves a claimed row and nothing else: the same fork asked
again starts its copy afresh and commits; ``DELETE`` of the run removes the claim.

The claim names its holder (``fork_claimed_by``, ``fork_claimer_started_at``: the replica and
which process of it, as a pending checkpoint names its requester, ``_requesters.py``). The same
fork asked of another replica while the holder is alive answers ``503 unavailable``
(``fork_in_progress``, ``Retry-After``): one copy goes into the fork's log, not two. Once the
holder is gone (its heartbeat lapsed, or it restarted) the asker takes the claim over and copies
afresh; ``commit`` and ``release`` act only for the claim's holder, so a holder that lost its
claim neither commits nor drops the new holder's work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import orjson
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._checkpoint_commit import CheckpointParts, write_checkpoint_parts_rows
from rolloutlog.catalog._reads import run_from_row
from rolloutlog.catalog._requesters import requester_gone, requester_incarnation
from rolloutlog.catalog._schema import RUN_VISIBLE, episodes, participants, runs
from rolloutlog.catalog._values import ManifestEntry, PartitionOffset, Restore, Run
from rolloutlog.catalog._writes import delete_run_rows, lock_run, open_checkpoint
from rolloutlog.errors import BackendUnavailable, InvalidRequest, RunExists, UnknownRun

__all__ = [
    "FORK_CHECKPOINT_ID",
    "FORK_RESTORE_ID",
    "ForkClaim",
    "claim",
    "commit",
    "forks_of",
    "inherited_restore",
    "refuse_if_being_forked",
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
    #: The holder a claim was taken over from (gone: its copy is partial), or None.
    taken_over_from: str | None = None


class _Holder(NamedTuple):
    """A claim's holder in the terms of ``requester_gone``."""

    requested_by: str | None
    requester_started_at: float | None


#: Seconds a caller refused ``fork_in_progress`` waits before asking again.
FORK_RETRY_AFTER_S = 1


_CLAIM = text(
    "INSERT INTO runs (run, partitions, log_url, created_at, forked_from_run, "
    "forked_from_checkpoint, fork_request, fork_claimed_by, fork_claimer_started_at) "
    "VALUES (:run, :partitions, :log_url, :now, :source, :checkpoint_id, :request, "
    ":claimed_by, :started_at) ON CONFLICT (run) DO NOTHING RETURNING run"
)


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
    backend: Backend,
    clock: Callable[[], float],
    claimed_by: str | None,
) -> ForkClaim:
    """Claim ``run`` for a fork of ``source``'s checkpoint ``checkpoint_id`` for the replica
    ``claimed_by`` (``RunExists`` if the name holds a run that is not this fork, or a fork
    asked differently; ``BackendUnavailable`` with ``fork_in_progress`` while another live
    replica holds the claim)."""
    wanted = request_json(request)
    incarnation = await requester_incarnation(conn, claimed_by)
    # Two claims at once: one inserts, the other (PostgreSQL: once the first committed) finds it.
    inserted = await conn.execute(
        _CLAIM,
        {
            "run": run,
            "partitions": partitions,
            "log_url": log_url,
            "now": now,
            "source": source,
            "checkpoint_id": checkpoint_id,
            "request": wanted,
            "claimed_by": claimed_by,
            "started_at": incarnation,
        },
    )
    new = inserted.first() is not None
    row = (await conn.execute(select(runs).where(runs.c.run == run).with_for_update())).one()
    if new:
        return ForkClaim("claimed", run_from_row(row))
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
    if row.forked_at is not None:
        return ForkClaim("created", found)
    holder = _Holder(row.fork_claimed_by, row.fork_claimer_started_at)
    if not await _holds(conn, row, claimed_by):
        gone = await requester_gone(conn, backend, clock, holder)
        if gone is None and holder.requested_by is not None:
            raise BackendUnavailable(
                f"run {run!r} is being forked by replica {holder.requested_by!r}: ask again "
                "shortly",
                run=run,
                fork_in_progress=True,
                holder=holder.requested_by,
                retry_after_s=FORK_RETRY_AFTER_S,
            )
    await conn.execute(
        update(runs)
        .where(runs.c.run == run)
        .values(fork_claimed_by=claimed_by, fork_claimer_started_at=incarnation)
    )
    return ForkClaim("claimed", found, taken_over_from=holder.requested_by)


async def refuse_if_being_forked(conn: AsyncConnection, run: str) -> None:
    """``RunExists`` if ``run`` is claimed by a fork still being created (a plain run of that
    name cannot be made: the name is the fork's, and once created it is a fork)."""
    row = (
        await conn.execute(
            select(runs.c.forked_from_run, runs.c.fork_request).where(
                runs.c.run == run, runs.c.forked_from_run.is_not(None), runs.c.forked_at.is_(None)
            )
        )
    ).one_or_none()
    if row is not None:
        raise RunExists(
            f"run {run!r} is being created as a fork of {row.forked_from_run!r}",
            run=run,
            settings={"fork": {"existing": orjson.loads(row.fork_request), "requested": None}},
            being_forked=True,
        )


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
    claimed_by: str | None,
) -> Run:
    """Create the claimed fork ``run`` whole: its checkpoint 1 with ``offsets`` and
    ``entries`` (cuts in the fork's own log), its episodes at their attempts (first seen at
    ``first_offsets``), its participants' epochs from the source's, and ``forked_at``."""
    await lock_run(conn, run)
    row = (await conn.execute(select(runs).where(runs.c.run == run))).one()
    if row.forked_from_run is None or row.forked_at is not None:
        raise InvalidRequest(f"run {run!r} is no fork being created", run=run)
    await _check_holder(conn, run, row, claimed_by)
    source = row.forked_from_run
    await open_checkpoint(
        conn, run, FORK_CHECKPOINT_ID, trigger="fork", controller_epoch=0, requested_at=now
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
    await conn.execute(
        update(runs)
        .where(runs.c.run == run)
        .values(forked_at=now, fork_claimed_by=None, fork_claimer_started_at=None)
    )
    return run_from_row((await conn.execute(select(runs).where(runs.c.run == run))).one())


async def _holds(conn: AsyncConnection, row: Any, claimed_by: str | None) -> bool:
    """Whether the fork claim in ``row`` is ``claimed_by``'s, this process of it."""
    incarnation = await requester_incarnation(conn, claimed_by)
    return (row.fork_claimed_by, row.fork_claimer_started_at) == (claimed_by, incarnation)


async def _check_holder(conn: AsyncConnection, run: str, row: Any, claimed_by: str | None) -> None:
    """``BackendUnavailable`` unless ``claimed_by`` (this process of it) still holds the claim
    in ``row``: a holder whose claim was taken over must not create the fork."""
    if not await _holds(conn, row, claimed_by):
        raise BackendUnavailable(
            f"the claim of fork {run!r} was taken over by replica {row.fork_claimed_by!r}: "
            "it creates the fork; ask again shortly",
            run=run,
            fork_in_progress=True,
            holder=row.fork_claimed_by,
            retry_after_s=FORK_RETRY_AFTER_S,
        )


async def release(conn: AsyncConnection, run: str, claimed_by: str | None) -> bool:
    """Drop a claim whose fork was not created, if ``claimed_by`` still holds it (False: there
    is none, it was created, or another replica took it over)."""
    row = (
        await conn.execute(
            select(runs.c.forked_at, runs.c.fork_claimed_by, runs.c.fork_claimer_started_at)
            .where(runs.c.run == run, runs.c.forked_from_run.is_not(None))
            .with_for_update()
        )
    ).one_or_none()
    if row is None or row.forked_at is not None:
        return False
    if not await _holds(conn, row, claimed_by):
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
