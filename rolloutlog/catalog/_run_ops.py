"""Runs, their participants and their episodes: the catalog's operations on them (``Catalog``
composes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _forks, _manifests, _reads, _results, _writes
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import check_count, check_episode, check_name, check_run_name
from rolloutlog.catalog._values import (
    DEFAULT_PARTITIONS,
    PARTICIPANT_KINDS,
    Episode,
    EpisodeFinish,
    EpisodeStart,
    EpisodeStatus,
    ManifestEntry,
    RegisteredParticipant,
    RestoreEntry,
    Run,
    RunStats,
    RunSummary,
)
from rolloutlog.errors import InvalidRequest, RunExists

_REGISTER = text(
    "INSERT INTO participants (run, participant_id, kind, epoch, registered_at, last_seen_at) "
    "VALUES (:run, :participant_id, :kind, 1, :now, :now) "
    "ON CONFLICT (run, participant_id) DO UPDATE SET epoch = participants.epoch + 1, "
    "registered_at = excluded.registered_at, last_seen_at = excluded.last_seen_at "
    "WHERE participants.kind = excluded.kind "
    "RETURNING epoch"
)
_CREATE_RUN = text(
    "INSERT INTO runs (run, partitions, log_url, created_at) "
    "VALUES (:run, :partitions, :log_url, :now) ON CONFLICT (run) DO NOTHING"
)
_TOUCH = text(
    "UPDATE participants SET last_seen_at = CASE WHEN last_seen_at < :seen THEN :seen "
    "ELSE last_seen_at END WHERE run = :run AND participant_id = :participant_id"
)
_EPISODES_STARTED = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, first_partition, first_offset, "
    "started_at, updated_at) VALUES (:run, :episode, 0, 'running', :partition, :offset, "
    ":started_at, :now) ON CONFLICT (run, episode) DO UPDATE SET "
    "first_partition = COALESCE(episodes.first_partition, excluded.first_partition), "
    "first_offset = COALESCE(episodes.first_offset, excluded.first_offset), "
    "started_at = COALESCE(episodes.started_at, excluded.started_at), "
    "updated_at = excluded.updated_at"
)
# A finish of an attempt older than the current one (fenced) does not change the episode.
_EPISODES_FINISHED = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, finished_at, updated_at) "
    "VALUES (:run, :episode, :attempt, 'finished', :finished_at, :now) "
    "ON CONFLICT (run, episode) DO UPDATE SET status = 'finished', "
    "finished_at = COALESCE(episodes.finished_at, excluded.finished_at), "
    "updated_at = excluded.updated_at "
    "WHERE episodes.current_attempt <= excluded.current_attempt"
)


class RunOperations(CatalogTransactions):
    """``Catalog``'s operations on runs, their participants and episodes."""

    async def create_run(
        self, run: str, *, partitions: int | None = None, log_url: str | None = None
    ) -> Run:
        """Create a run, or return it if it exists with the same settings (else ``RunExists``).

        ``None`` settings mean "as stored" for an existing run and the defaults for a new one.
        """
        check_run_name(run)
        if partitions is not None:
            check_count(partitions, "partitions", minimum=1)
        if log_url is not None:
            check_name(log_url, "log_url")
        async with self._write() as conn:
            await conn.execute(
                _CREATE_RUN,
                {
                    "run": run,
                    "partitions": partitions if partitions is not None else DEFAULT_PARTITIONS,
                    "log_url": log_url,
                    "now": self._clock(),
                },
            )
            await _forks.refuse_if_being_forked(conn, run)
            found = await _reads.get_run(conn, run)
        differs = {
            name: {"existing": existing, "requested": requested}
            for name, existing, requested in (
                ("partitions", found.partitions, partitions),
                ("log_url", found.log_url, log_url),
            )
            if requested is not None and requested != existing
        }
        if differs:
            raise RunExists(f"run {run!r} exists with other settings", run=run, settings=differs)
        return found

    async def get_run(self, run: str) -> Run:
        return await self._query(lambda conn: _reads.get_run(conn, run))

    async def run_summary(self, run: str) -> RunSummary:
        """One run with its counts."""

        async def query(conn: AsyncConnection) -> RunSummary:
            return (await _reads.summarize_runs(conn, [await _reads.get_run(conn, run)]))[0]

        return await self._query(query)

    async def list_runs(
        self,
        *,
        after: str | None = None,
        limit: int = 100,
        keep: Callable[[str], bool] | None = None,
    ) -> list[RunSummary]:
        """Runs with counts, by name; page with ``after=<last run's name>``; ``keep`` (a run's
        name → whether to list it) filters before anything is counted."""
        check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.list_runs(conn, after, limit, keep))

    async def register_participant(self, run: str, participant_id: str, kind: str) -> int:
        """Register (or re-register) a participant; return its new epoch (1, 2, …)."""
        check_name(participant_id, "participant_id")
        if kind not in PARTICIPANT_KINDS:
            raise InvalidRequest(
                f"participant kind must be one of {sorted(PARTICIPANT_KINDS)}, not {kind!r}",
                field="kind",
            )
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            epoch = (
                await conn.execute(
                    _REGISTER,
                    {
                        "run": run,
                        "participant_id": participant_id,
                        "kind": kind,
                        "now": self._clock(),
                    },
                )
            ).scalar_one_or_none()
            if epoch is None:
                existing = await conn.execute(
                    text(
                        "SELECT kind FROM participants WHERE run = :run AND participant_id = :pid"
                    ),
                    {"run": run, "pid": participant_id},
                )
                raise InvalidRequest(
                    f"participant {participant_id!r} is registered as another kind",
                    field="kind",
                    registered_kind=existing.scalar_one(),
                )
            return int(epoch)

    async def touch_participants(self, run: str, seen: Mapping[str, float]) -> None:
        """Record when participants were last seen (never moves a time backwards)."""
        if not seen:
            return
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            await conn.execute(
                _TOUCH,
                [{"run": run, "participant_id": pid, "seen": at} for pid, at in seen.items()],
            )

    async def list_participants(self, run: str) -> list[RegisteredParticipant]:
        return await self._query(lambda conn: _reads.list_participants(conn, run))

    async def record_episodes(
        self,
        run: str,
        started: Sequence[EpisodeStart] = (),
        finished: Sequence[EpisodeFinish] = (),
    ) -> None:
        """Record episodes' starts and finishes for analysts, as the projector folds them.

        Starts keep the first position and time recorded; a finish marks the episode
        ``finished`` unless a restore has made a newer attempt current. Attempts themselves are
        the restores' to set. (Checkpoint commits do not touch this table: keeping 16,000 rows
        of it current would double a commit's cost.)
        """
        if not started and not finished:
            return
        for start in started:
            check_episode(start.episode)
        for finish in finished:
            check_episode(finish.episode)
            check_count(finish.attempt, "attempt")
        now = self._clock()
        async with self._write() as conn:
            await _reads.get_run(conn, run)
            if started:
                await conn.execute(
                    _EPISODES_STARTED,
                    [
                        {
                            "run": run,
                            "episode": start.episode,
                            "partition": start.partition,
                            "offset": start.offset,
                            "started_at": start.started_at,
                            "now": now,
                        }
                        for start in started
                    ],
                )
            if finished:
                await conn.execute(
                    _EPISODES_FINISHED,
                    [
                        {
                            "run": run,
                            "episode": finish.episode,
                            "attempt": finish.attempt,
                            "finished_at": finish.finished_at,
                            "now": now,
                        }
                        for finish in finished
                    ],
                )
                await _results.record(conn, run, finished, now)

    async def get_episode(self, run: str, episode: str) -> Episode:
        return await self._query(lambda conn: _reads.get_episode(conn, run, episode))

    async def list_episodes(
        self,
        run: str,
        *,
        status: EpisodeStatus | None = None,
        after: str | None = None,
        limit: int = 1000,
    ) -> list[Episode]:
        """Episodes by id, optionally of one status; page with ``after=<last episode>``."""
        check_count(limit, "limit", minimum=1)
        return await self._query(lambda conn: _reads.list_episodes(conn, run, status, after, limit))

    async def current_attempts(self, run: str) -> dict[str, int]:
        """Every recorded episode's current attempt (episodes absent here are at attempt 0)."""
        return await self._query(lambda conn: _reads.current_attempts(conn, run))

    async def run_stats(self, run: str) -> RunStats:
        return await self._query(lambda conn: _reads.run_stats(conn, run))

    async def episode_plan_entries(self, run: str, episode: str) -> list[tuple[int, RestoreEntry]]:
        """``(restore_id, entry)`` of every restore whose plan names the episode, oldest first."""
        check_episode(episode)
        return await self._query(lambda conn: _reads.episode_plan_entries(conn, run, episode))

    async def episode_manifest_entries(
        self, run: str, episode: str, partition: int
    ) -> list[tuple[int, ManifestEntry]]:
        """``(checkpoint_id, entry)`` of every kept committed manifest naming the episode (which
        lives in ``partition``), oldest first."""
        check_episode(episode)
        return await self._query(
            lambda conn: _manifests.episode_manifest_entries(conn, run, episode, partition)
        )

    async def delete_run(self, run: str) -> None:
        """Delete the run and every row that belongs to it, in one transaction (``UnknownRun``
        when there is no such run); the name can be created afresh."""
        check_run_name(run)
        async with self._write() as conn:
            await _writes.delete_run_rows(conn, run)
