"""A restore's commit: the plan's checks, its rows and the episodes' new attempts, and the restore
ids reserved ahead of it."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from operator import gt
from typing import Any, NoReturn

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import _reads
from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._manifests import compose_parts, manifest_bodies
from rolloutlog.catalog._schema import NAME_LENGTH, episodes, restore_episodes, restores, runs
from rolloutlog.catalog._validate import check_count, check_episode
from rolloutlog.catalog._values import RESTORE_ACTIONS, Restore, RestoreEntry, capture_key
from rolloutlog.catalog._writes import lock_run
from rolloutlog.errors import InvalidRequest, RestoreConflict, UnknownCheckpoint, UnknownEpisode
from rolloutlog.log import NAME_PATTERN, episode_id_problem

RESTORE_EPISODE_COLUMNS = (
    "run",
    "restore_id",
    "episode",
    "previous_attempt",
    "attempt",
    "capture_key",
    "action",
    "reason",
)
# Each episode's new attempt made current, set-based from the restore episodes just inserted
# (one statement each, not one per episode), only where its current attempt is the plan's
# previous one (0: it has none yet): a statement changes fewer rows than the plan has when the
# plan is stale. The first sets no status (the episode's stays what the plan makes it), so its
# index is left alone: on SQLite a status in the SET rewrites each row's index entry whatever its
# value, which made the statement twice as slow for 16,000 entries.
_PLANNED_STATUS = "CASE WHEN r.action = 'excluded' THEN 'excluded' ELSE 'running' END"
_OF_THE_PLAN = "r.run = :run AND r.restore_id = :restore_id"
_SAME_STATUS = text(
    "UPDATE episodes AS e SET current_attempt = r.attempt, updated_at = :now "
    f"FROM restore_episodes AS r WHERE {_OF_THE_PLAN} AND e.run = r.run "
    f"AND e.episode = r.episode AND e.current_attempt = r.previous_attempt "
    f"AND e.status = {_PLANNED_STATUS}"
)
_NEW_STATUS = text(
    f"UPDATE episodes AS e SET current_attempt = r.attempt, status = {_PLANNED_STATUS}, "
    f"updated_at = :now FROM restore_episodes AS r WHERE {_OF_THE_PLAN} AND e.run = r.run "
    f"AND e.episode = r.episode AND e.current_attempt = r.previous_attempt "
    f"AND e.status <> {_PLANNED_STATUS}"
)
# Those with no row yet: the key's conflict skips the others. (Written as ``NOT EXISTS`` over
# ``episodes``, PostgreSQL planned a nested loop whose inner scan met every row the statement had
# inserted so far: 16,000 new episodes took 8-10 s, benchmarks/catalog_commit.py.)
_FIRST_ATTEMPT = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, updated_at) "
    f"SELECT r.run, r.episode, r.attempt, {_PLANNED_STATUS}, :now FROM restore_episodes AS r "
    f"WHERE {_OF_THE_PLAN} AND r.previous_attempt = 0 "
    "ON CONFLICT (run, episode) DO NOTHING"
)


async def _make_current(
    conn: AsyncConnection,
    backend: Backend,
    keys: Mapping[str, Any],
    entries: Sequence[RestoreEntry],
) -> bool:
    """Make the plan's attempts current (its ``restore_episodes`` rows, inserted under
    ``keys``); False, the transaction to be rolled back, if some episode's current attempt is
    not the plan's previous one. Each statement runs only while rows are left: a restore
    usually changes no status and inserts no episode (a stale plan's episodes, matched by
    none, run them all). The rows were just inserted: joined by hash (``Backend.join_by_hash``)."""
    changed = 0
    await backend.join_by_hash(conn, True)
    for statement in (_SAME_STATUS, _FIRST_ATTEMPT, _NEW_STATUS):
        if changed == len(entries):
            break
        changed += (await conn.execute(statement, keys)).rowcount
    await backend.join_by_hash(conn, False)
    return changed == len(entries)


async def _current_attempts(
    conn: AsyncConnection, backend: Backend, run: str, named: Sequence[str]
) -> dict[str, int]:
    """The current attempts of the ``named`` episodes that have one (one query: ``among``)."""
    found = await conn.execute(
        select(episodes.c.episode, episodes.c.current_attempt).where(
            episodes.c.run == run, backend.among(episodes.c.episode, named)
        )
    )
    return dict(found.all())


async def reserve_restore_id(conn: AsyncConnection, run: str, controller_epoch: int) -> int:
    """Take the run's next restore id for a restore that writes log records before it commits.

    Ids are never handed out twice, so the records of a restore that died before its commit can
    never be mistaken for those of a later one (its id just stays unused).
    """
    row = await lock_run(conn, run, controller_epoch)
    restore_id = int(row.last_restore_id) + 1
    await conn.execute(update(runs).where(runs.c.run == run).values(last_restore_id=restore_id))
    return restore_id


async def check_reserved_restore_id(
    conn: AsyncConnection, run: str, run_row: Any, restore_id: int
) -> None:
    """A reserved id commits once, and only while no later restore has committed."""
    newest = (
        await conn.execute(select(func.max(restores.c.restore_id)).where(restores.c.run == run))
    ).scalar_one_or_none()
    if restore_id > int(run_row.last_restore_id) or restore_id <= int(newest or 0):
        raise RestoreConflict(
            f"restore id {restore_id} of run {run!r} was not reserved, or a restore with this "
            f"or a later id has committed (newest committed: {int(newest or 0)})",
            run=run,
            restore_id=restore_id,
            newest_restore_id=int(newest or 0),
        )


async def commit_restore_rows(
    conn: AsyncConnection,
    backend: Backend,
    *,
    run: str,
    controller_epoch: int,
    checkpoint_id: int,
    entries: Sequence[RestoreEntry],
    timings_ms: dict[str, float],
    now: float,
    restore_id: int | None = None,
) -> Restore:
    """Commit a restore plan (``Catalog.commit_restore`` says what is checked): its row, its
    episodes' rows, and each episode's new attempt current in ``episodes``."""
    run_row = await lock_run(conn, run, controller_epoch)
    manifest = await _committed_manifest(conn, run, checkpoint_id)
    reserved = restore_id is not None
    if restore_id is None:
        restore_id = int(run_row.last_restore_id) + 1
    else:
        await check_reserved_restore_id(conn, run, run_row, restore_id)
    columns, counts = _plan_rows(run, restore_id, entries)
    if not _agrees_with_manifest(columns, manifest):
        await _disagreement(conn, backend, run, checkpoint_id, entries, manifest)
    if not reserved:
        await conn.execute(update(runs).where(runs.c.run == run).values(last_restore_id=restore_id))
    restore = Restore(
        run=run,
        restore_id=restore_id,
        checkpoint_id=checkpoint_id,
        controller_epoch=controller_epoch,
        committed_at=now,
        continue_count=counts["continue"],
        restart_count=counts["restart"],
        excluded_count=counts["excluded"],
        timings_ms=timings_ms,
    )
    values = {name: getattr(restore, name) for name in _RESTORE_COLUMNS}
    await conn.execute(
        insert(restores).values(**values, timings_ms=_reads.encode_json_map(timings_ms))
    )
    await backend.bulk_insert(conn, restore_episodes, RESTORE_EPISODE_COLUMNS, columns)
    # Under a savepoint: a stale plan's error names episodes by their current attempts as they
    # were, not as the statements left them.
    savepoint = await conn.begin_nested()
    keys = {"run": run, "restore_id": restore_id, "now": now}
    if not await _make_current(conn, backend, keys, entries):
        await savepoint.rollback()
        await _disagreement(conn, backend, run, checkpoint_id, entries, manifest)
    await savepoint.commit()
    return restore


#: The ``restores`` columns a ``Restore`` holds as stored (``timings_ms`` is encoded).
_RESTORE_COLUMNS = (
    "run",
    "restore_id",
    "checkpoint_id",
    "controller_epoch",
    "committed_at",
    "continue_count",
    "restart_count",
    "excluded_count",
)


async def _committed_manifest(
    conn: AsyncConnection, run: str, checkpoint_id: int
) -> dict[str, str]:
    """Each episode of a committed checkpoint's manifest with its action (``UnknownCheckpoint``
    for any other checkpoint)."""
    status = await _reads.checkpoint_status(conn, run, checkpoint_id)
    if status != "committed":
        raise UnknownCheckpoint(
            f"checkpoint {checkpoint_id} of run {run!r} "
            + ("does not exist" if status is None else f"is {status}")
            + ": only a committed checkpoint can be restored",
            run=run,
            checkpoint_id=checkpoint_id,
            status=status,
        )
    bodies, _ = await manifest_bodies(conn, run, checkpoint_id)
    with collector_paused():
        return {entry[0]: entry[2] for entry in compose_parts(bodies)}


def _plan_rows(
    run: str, restore_id: int, entries: Sequence[RestoreEntry]
) -> tuple[list[list[Any]], dict[str, int]]:
    """The plan's ``restore_episodes`` rows, column-wise (``RESTORE_EPISODE_COLUMNS``), and its
    counts per action."""
    count = len(entries)
    episodes_: list[str] = [entry.episode for entry in entries]
    attempts: list[int] = [entry.attempt for entry in entries]
    actions: list[str] = [entry.action for entry in entries]
    counts = {"continue": 0, "restart": 0, "excluded": 0}
    counts.update(Counter(actions))
    columns: list[list[Any]] = [
        [run] * count,
        [restore_id] * count,
        episodes_,
        [entry.previous_attempt for entry in entries],
        attempts,
        list(map(capture_key, episodes_, attempts)),
        actions,
        [entry.reason for entry in entries],
    ]
    return columns, counts


def _agrees_with_manifest(columns: Sequence[Sequence[Any]], manifest: Mapping[str, str]) -> bool:
    """Whether the plan's rows (``_plan_rows``) agree with the manifest: each action allowed
    for the episode's action there (``_ALLOWED``), every live episode of it planned. Whole
    columns at C speed (a restore commits 16,000 entries)."""
    episodes_, actions = columns[2], columns[6]
    planned = list(map(manifest.get, episodes_))
    live = {episode for episode, action in manifest.items() if action != "finished"}
    return _ALLOWED.issuperset(zip(planned, actions, strict=True)) and live <= set(episodes_)


async def _disagreement(
    conn: AsyncConnection,
    backend: Backend,
    run: str,
    checkpoint_id: int,
    entries: Sequence[RestoreEntry],
    manifest: Mapping[str, str],
) -> NoReturn:
    """Raise the error naming what of a plan disagrees with the manifest or the episodes'
    current attempts (``_plan_disagreement``), those read only now that it is known to."""
    current = await _current_attempts(conn, backend, run, [entry.episode for entry in entries])
    _plan_disagreement(run, checkpoint_id, entries, manifest, current)


#: (the manifest's action, the plan's) that agree: a finished episode may only be excluded, a
#: restart-only one not continued, one the manifest does not name (begun after its markers,
#: None) not continued.
_ALLOWED = frozenset(
    [
        *(
            (manifest, action)
            for manifest in (None, "restart")
            for action in ("restart", "excluded")
        ),
        ("continue", "continue"),
        ("continue", "restart"),
        ("continue", "excluded"),
        ("finished", "excluded"),
    ]
)


def _plan_disagreement(
    run: str,
    checkpoint_id: int,
    entries: Sequence[RestoreEntry],
    manifest: Mapping[str, str],
    current: Mapping[str, int],
) -> NoReturn:
    """Raise the error naming the first entry of a plan that disagrees with the manifest or
    the current attempts, else the live episodes it leaves out."""
    for entry in entries:
        episode, action = entry.episode, entry.action
        planned = manifest.get(episode)
        if planned is None and action == "continue":
            raise UnknownEpisode(
                f"episode {episode!r} is not in the manifest of checkpoint {checkpoint_id}",
                run=run,
                checkpoint_id=checkpoint_id,
                episode=episode,
            )
        if (planned == "finished" and action != "excluded") or (
            planned == "restart" and action == "continue"
        ):
            raise InvalidRequest(
                f"episode {episode!r} is {planned} in checkpoint {checkpoint_id}; "
                f"it cannot be restored as {action}",
                episode=episode,
                manifest_action=planned,
                action=action,
            )
        attempt_now = current.get(episode, 0)
        if entry.previous_attempt != attempt_now:
            raise InvalidRequest(
                f"episode {episode!r} is at attempt {attempt_now}, the plan assumed "
                f"{entry.previous_attempt}: the plan is stale",
                episode=episode,
                current_attempt=attempt_now,
                previous_attempt=entry.previous_attempt,
            )
    planned_episodes = {entry.episode for entry in entries}
    missing = sorted(
        episode
        for episode, action in manifest.items()
        if action != "finished" and episode not in planned_episodes
    )
    raise InvalidRequest(
        f"the restore plan leaves {len(missing)} live episode(s) of checkpoint "
        f"{checkpoint_id} unaccounted for",
        episodes=missing[:20],
    )


def check_plan(entries: Sequence[RestoreEntry]) -> None:
    """Raise the error naming the first invalid entry of a restore plan (none: it is valid)."""
    if not _plan_looks_valid(entries):
        _check_plan(entries)


_EPISODE_NAME = re.compile(NAME_PATTERN)


def _plan_looks_valid(entries: Sequence[RestoreEntry]) -> bool:
    """``_check_plan``'s checks over whole columns with C-level builtins (a restore commits
    16,000 entries); when this says no, ``_check_plan`` finds the entry to name."""
    if not entries:
        return True
    if set(map(type, entries)) != {RestoreEntry}:
        return False
    episodes, previous, attempts, actions, _ = zip(*entries, strict=True)
    return (
        set(map(type, episodes)) == {str}
        and len(set(episodes)) == len(episodes)
        and max(map(len, episodes)) <= NAME_LENGTH
        and all(map(_EPISODE_NAME.match, episodes))
        and not any("-a" in episode and episode_id_problem(episode) for episode in episodes)
        and set(actions) <= RESTORE_ACTIONS
        and set(map(type, previous)) == {int}
        and set(map(type, attempts)) == {int}
        and min(previous) >= 0
        and all(map(gt, attempts, previous))
    )


def _check_plan(entries: Sequence[RestoreEntry]) -> None:
    """Raise the error naming the first invalid entry of a restore plan."""
    seen: set[str] = set()
    for entry in entries:
        check_episode(entry.episode)
        if entry.episode in seen:
            raise InvalidRequest(
                f"episode {entry.episode!r} appears twice in the restore plan",
                episode=entry.episode,
            )
        seen.add(entry.episode)
        if entry.action not in RESTORE_ACTIONS:
            raise InvalidRequest(
                f"restore action must be one of {sorted(RESTORE_ACTIONS)}",
                episode=entry.episode,
            )
        check_count(entry.previous_attempt, "previous_attempt")
        check_count(entry.attempt, "attempt", minimum=entry.previous_attempt + 1)
