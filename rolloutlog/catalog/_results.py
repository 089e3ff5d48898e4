"""Finished episodes' results and their acknowledgement: the statements behind the
catalog's ``record_episodes`` (results part), ``results_page``, ``acknowledge_results`` and the
restore commit's bookkeeping.

A result is valid while no restore has abandoned its attempt: a restore that continues or
restarts an episode makes its earlier finish part of the timeline it abandons (the row goes, and a
late copy of it is never recorded), while an exclusion keeps it (the trainer holds that result).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._schema import checkpoint_offsets, checkpoints, episodes, results
from rolloutlog.catalog._values import EpisodeFinish, FinishedResult
from rolloutlog.errors import UnknownCheckpoint

__all__ = [
    "acknowledge",
    "count_unacknowledged",
    "drop_abandoned",
    "page",
    "record",
    "result_episodes",
]

# A newer attempt's finish replaces an abandoned one's (and is not acknowledged yet); the same
# attempt's finish folded again (a restarted projector reads it again) changes nothing.
_UPSERT = text(
    "INSERT INTO results (run, episode, attempt, partition, finished_offset, ts, reward, result, "
    "recorded_at) VALUES (:run, :episode, :attempt, :partition, :offset, :ts, :reward, :result, "
    ":now) ON CONFLICT (run, episode) DO UPDATE SET attempt = excluded.attempt, "
    "partition = excluded.partition, finished_offset = excluded.finished_offset, "
    "ts = excluded.ts, reward = excluded.reward, result = excluded.result, "
    "recorded_at = excluded.recorded_at, acknowledged_at = NULL "
    "WHERE results.attempt < excluded.attempt"
)
_IN_BATCH = 10_000


def _valid(finish: EpisodeFinish, current: dict[str, tuple[int, str]]) -> bool:
    """Whether no committed restore abandoned the finished attempt: the episode is still at it,
    or a restore excluded it right after it (its current attempt is the excluded one)."""
    found = current.get(finish.episode)
    if found is None:
        return True
    attempt, status = found
    return attempt <= finish.attempt or (status == "excluded" and attempt == finish.attempt + 1)


async def record(
    conn: AsyncConnection, run: str, finished: Sequence[EpisodeFinish], now: float
) -> None:
    """Keep the results of ``finished`` (those with a position) whose attempt is still valid."""
    located = [f for f in finished if f.partition is not None and f.offset is not None]
    if not located:
        return
    names = sorted({f.episode for f in located})
    current: dict[str, tuple[int, str]] = {}
    for start in range(0, len(names), _IN_BATCH):
        rows = await conn.execute(
            select(episodes.c.episode, episodes.c.current_attempt, episodes.c.status).where(
                episodes.c.run == run, episodes.c.episode.in_(names[start : start + _IN_BATCH])
            )
        )
        current.update((str(e), (int(a), str(s))) for e, a, s in rows)
    kept = [
        {
            "run": run,
            "episode": f.episode,
            "attempt": f.attempt,
            "partition": f.partition,
            "offset": f.offset,
            "ts": f.finished_at,
            "reward": f.reward,
            "result": f.result.decode() if f.result is not None else None,
            "now": now,
        }
        for f in located
        if _valid(f, current)
    ]
    if kept:
        await conn.execute(_UPSERT, kept)


async def drop_abandoned(
    conn: AsyncConnection, backend: Backend, run: str, abandoned: Sequence[str]
) -> None:
    """A restore's part: the results of the attempts it continued or restarted (``abandoned``)
    are gone. Named by the plan, not joined against its fresh ``restore_episodes`` rows: on
    PostgreSQL that join was planned blind (neither table analyzed yet) as a nested loop, 6-12 s
    for S3's 2,000 results and 15,686 continued episodes."""
    if abandoned:
        await conn.execute(
            delete(results).where(results.c.run == run, backend.among(results.c.episode, abandoned))
        )


async def count_unacknowledged(conn: AsyncConnection, run: str) -> int:
    found = await conn.execute(
        select(func.count())
        .select_from(results)
        .where(results.c.run == run, results.c.acknowledged_at.is_(None))
    )
    return int(found.scalar_one())


async def result_episodes(conn: AsyncConnection, run: str) -> set[str]:
    """Every episode the catalog holds a result of (acknowledged or not)."""
    found = await conn.execute(select(results.c.episode).where(results.c.run == run))
    return {str(episode) for episode in found.scalars()}


async def acknowledge(
    conn: AsyncConnection, run: str, names: Sequence[str], now: float
) -> tuple[int, list[str]]:
    """Acknowledge the results of ``names``: (how many were not acknowledged before, the names
    the catalog holds no result of). Acknowledging again changes nothing."""
    wanted = sorted(set(names))
    newly = 0
    known: set[str] = set()
    for start in range(0, len(wanted), _IN_BATCH):
        batch = wanted[start : start + _IN_BATCH]
        updated = await conn.execute(
            update(results)
            .where(
                results.c.run == run,
                results.c.episode.in_(batch),
                results.c.acknowledged_at.is_(None),
            )
            .values(acknowledged_at=now)
        )
        newly += int(updated.rowcount)
        found = await conn.execute(
            select(results.c.episode).where(results.c.run == run, results.c.episode.in_(batch))
        )
        known.update(str(e) for e in found.scalars())
    return newly, [name for name in wanted if name not in known]


async def page(
    conn: AsyncConnection,
    run: str,
    *,
    since_checkpoint: int | None,
    names: Collection[str] | None,
    unacknowledged: bool,
    after: str | None,
    limit: int | None,
) -> list[FinishedResult]:
    """Results by episode id, filtered; page with ``after=<last episode>``.

    ``since_checkpoint``: only results that finished at or past that checkpoint's marker in
    their partition (the checkpoint must be committed or expired: its offsets stay).
    """
    query = select(
        results.c.episode,
        results.c.attempt,
        results.c.partition,
        results.c.finished_offset,
        results.c.ts,
        results.c.reward,
        results.c.result,
        results.c.acknowledged_at,
    ).where(results.c.run == run)
    if since_checkpoint is not None:
        await _check_has_offsets(conn, run, since_checkpoint)
        query = query.join(
            checkpoint_offsets,
            (checkpoint_offsets.c.run == results.c.run)
            & (checkpoint_offsets.c.checkpoint_id == since_checkpoint)
            & (checkpoint_offsets.c.partition == results.c.partition),
        ).where(results.c.finished_offset >= checkpoint_offsets.c.marker_offset)
    if unacknowledged:
        query = query.where(results.c.acknowledged_at.is_(None))
    if names is not None:
        query = query.where(results.c.episode.in_(sorted(names)))
    if after is not None:
        query = query.where(results.c.episode > after)
    query = query.order_by(results.c.episode)
    if limit is not None:
        query = query.limit(limit)
    return [_result(row) for row in await conn.execute(query)]


def _result(row: Any) -> FinishedResult:
    raw = row.result
    return FinishedResult(
        episode=str(row.episode),
        attempt=int(row.attempt),
        partition=int(row.partition),
        finished_offset=int(row.finished_offset),
        ts=float(row.ts),
        reward=float(row.reward) if row.reward is not None else None,
        result=raw.encode() if raw is not None else None,
        acknowledged_at=float(row.acknowledged_at) if row.acknowledged_at is not None else None,
    )


async def _check_has_offsets(conn: AsyncConnection, run: str, checkpoint_id: int) -> None:
    status = (
        await conn.execute(
            select(checkpoints.c.status).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).scalar_one_or_none()
    if status not in ("committed", "expired"):
        raise UnknownCheckpoint(
            f"run {run!r} has no committed checkpoint {checkpoint_id}"
            + (f" (it is {status})" if status is not None else ""),
            run=run,
            checkpoint_id=checkpoint_id,
            status=status,
        )
