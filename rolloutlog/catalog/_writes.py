"""The two large write transactions (checkpoint commit, restore commit) and their shared checks."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter, gt, itemgetter
from typing import Any

import orjson
from sqlalchemy import delete, func, insert, select, text, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import _reads
from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._leases import check_leases
from rolloutlog.catalog._reads import compose_parts, manifest_bodies
from rolloutlog.catalog._schema import (
    NAME_LENGTH,
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
from rolloutlog.catalog._validate import check_count, check_episode
from rolloutlog.catalog._values import (
    QUARANTINE_FIRST_BYTES,
    REMOVED,
    RESTORE_ACTIONS,
    Checkpoint,
    ManifestEntry,
    PartitionOffset,
    QuarantinedRecord,
    Restore,
    RestoreEntry,
    capture_key,
)
from rolloutlog.errors import (
    CheckpointNotPending,
    InvalidRequest,
    RestoreConflict,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRun,
)
from rolloutlog.log import NAME_PATTERN, episode_id_problem

MANIFEST_PART_COLUMNS = ("run", "checkpoint_id", "cut_partition", "entries", "entry_count")
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
# ``offset`` is an SQL keyword: quoted.
_QUARANTINE = text(
    'INSERT INTO quarantined_records (run, partition, "offset", reason, size, first_bytes, '
    "recorded_at) VALUES (:run, :partition, :offset, :reason, :size, :first_bytes, :recorded_at) "
    'ON CONFLICT (run, partition, "offset") DO NOTHING'
)
# Set-based from the restore episodes just inserted: one statement, not one per episode.
_EPISODES_RESTORED = text(
    "INSERT INTO episodes (run, episode, current_attempt, status, updated_at) "
    "SELECT run, episode, attempt, "
    "CASE WHEN action = 'excluded' THEN 'excluded' ELSE 'running' END, :now "
    "FROM restore_episodes WHERE run = :run AND restore_id = :restore_id "
    "ON CONFLICT (run, episode) DO UPDATE SET current_attempt = excluded.current_attempt, "
    "status = excluded.status, updated_at = excluded.updated_at"
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
        current = int(row.controller_epoch)
        if current == 0:
            raise StaleController(
                f"run {run!r} has no controller yet: take over the controller first",
                run=run,
                controller_epoch=controller_epoch,
                current_epoch=current,
            )
        if controller_epoch != current:
            raise StaleController(
                f"controller epoch {controller_epoch} of run {run!r} is stale (current: {current})",
                run=run,
                controller_epoch=controller_epoch,
                current_epoch=current,
            )
    return row


async def pending_checkpoint(conn: AsyncConnection, run: str, checkpoint_id: int) -> Any:
    row = (
        await conn.execute(
            select(checkpoints).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).one_or_none()
    if row is None:
        raise UnknownCheckpoint(
            f"run {run!r} has no checkpoint {checkpoint_id}", run=run, checkpoint_id=checkpoint_id
        )
    if row.status != "pending":
        raise CheckpointNotPending(
            f"checkpoint {checkpoint_id} of run {run!r} is {row.status}, not pending",
            run=run,
            checkpoint_id=checkpoint_id,
            status=row.status,
        )
    return row


def _bad_entry(entry: ManifestEntry, problem: str) -> InvalidRequest:
    return InvalidRequest(
        f"manifest entry of episode {entry.episode!r}: {problem}", episode=entry.episode
    )


_INT = {int}
_STAGE_TYPES = {str, type(None)}
_KEY_CONTAINERS = {tuple, list}


def manifest_columns(
    run: str,
    checkpoint_id: int,
    entries: Sequence[ManifestEntry],
    removed: Sequence[ManifestEntry] = (),
) -> tuple[list[Sequence[Any]], dict[str, int], int]:
    """Check entries and encode them as ``manifest_parts`` columns (``MANIFEST_PART_COLUMNS``
    order: one row per cut partition, its entries in episode order as one JSON array); return
    (columns, counts per action, total bytes).

    This runs inside a checkpoint's time budget for 16,000 entries, so it checks whole columns
    with C-level builtins (``zip``, ``map``, ``set``, ``min``) instead of looping in Python; when
    a check fails, ``_first_bad_entry`` finds the culprit to name it in the error.
    """
    count = len(entries)
    counts = {"continue": 0, "restart": 0, "finished": 0}
    if removed:
        check = {entry.episode for entry in entries}
        if set(map(type, removed)) != {ManifestEntry} or any(r[0] in check for r in removed):
            raise InvalidRequest(
                "removed entries must be ManifestEntry values of episodes not in entries",
                field="removed",
            )
        new = tuple.__new__  # an action no ManifestEntry carries outside a stored part
        tombstones = [new(ManifestEntry, (r[0], r[1], REMOVED, r[3], r[4])) for r in removed]
    else:
        tombstones = []
    if not count:
        if not tombstones:
            return [[] for _ in MANIFEST_PART_COLUMNS], counts, 0
        return _part_columns(run, checkpoint_id, tombstones), counts, 0
    if set(map(type, entries)) != {ManifestEntry}:
        raise InvalidRequest("manifest entries must be ManifestEntry values", field="entries")
    ordered = sorted(entries, key=itemgetter(0))
    episodes, attempts, actions, partitions, offsets, stages, keys, sizes, reasons = zip(
        *ordered, strict=True
    )
    integers = (attempts, partitions, offsets, sizes)
    lengths = set(map(len, episodes)) if set(map(type, episodes)) == {str} else {0}
    key_types = (
        set(map(type, chain.from_iterable(keys)))
        if set(map(type, keys)) <= _KEY_CONTAINERS
        else {int}
    )
    action_counts = Counter(actions)
    if (
        len(set(episodes)) != count
        or min(lengths) < 1
        or max(lengths) > NAME_LENGTH
        or any(set(map(type, column)) != _INT or min(column) < 0 for column in integers)
        or not set(action_counts) <= counts.keys()
        or not set(map(type, stages)) <= _STAGE_TYPES
        or not set(map(type, reasons)) <= _STAGE_TYPES
        or not key_types <= {str}
    ):
        raise _first_bad_entry(entries)
    for episode in episodes:
        if "-a" in episode:
            check_episode(episode)
    counts.update(action_counts)
    if tombstones:
        ordered = sorted([*ordered, *tombstones], key=itemgetter(0))
    return _part_columns(run, checkpoint_id, ordered), counts, sum(sizes)


def _part_columns(
    run: str, checkpoint_id: int, ordered: Sequence[ManifestEntry]
) -> list[Sequence[Any]]:
    parts: dict[int, list[ManifestEntry]] = {}
    for entry in ordered:
        parts.setdefault(entry[3], []).append(entry)
    numbers = sorted(parts)
    # Entries are tuples of the JSON array's fields; orjson encodes them at C speed.
    bodies = [orjson.dumps(parts[number], default=tuple).decode() for number in numbers]
    return [
        [run] * len(numbers),
        [checkpoint_id] * len(numbers),
        numbers,
        bodies,
        [len(parts[number]) for number in numbers],
    ]


def _first_bad_entry(entries: Sequence[ManifestEntry]) -> InvalidRequest:
    """The error naming the first entry that ``manifest_columns``' checks refused."""
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, ManifestEntry):
            return InvalidRequest("manifest entries must be ManifestEntry values", field="entries")
        episode, attempt, action, partition, offset, stage, keys, size, reason = entry
        if not isinstance(episode, str) or not 1 <= len(episode) <= NAME_LENGTH:
            return _bad_entry(entry, f"episode must be a string of 1-{NAME_LENGTH} characters")
        if episode in seen:
            return _bad_entry(entry, "the episode appears twice")
        seen.add(episode)
        for value in (attempt, partition, offset, size):
            if type(value) is not int or value < 0:
                return _bad_entry(entry, "attempt, cut and size_bytes must be integers >= 0")
        if action not in ("continue", "restart", "finished"):
            return _bad_entry(entry, f"action must be continue, restart or finished: {action!r}")
        if stage is not None and type(stage) is not str:
            return _bad_entry(entry, "last_stage must be a string or None")
        if type(keys) not in _KEY_CONTAINERS or any(type(key) is not str for key in keys):
            return _bad_entry(entry, "staging_keys must be a tuple of strings")
        if reason is not None and type(reason) is not str:
            return _bad_entry(entry, "reason must be a string or None")
    return InvalidRequest("invalid manifest entries", field="entries")


def _check_offsets(
    run: str, partitions: int, offsets: Sequence[PartitionOffset], generations: Mapping[int, int]
) -> list[int]:
    """The writer's partitions (sorted): those of ``offsets``, each once, of the run, and
    exactly those of ``generations`` when it fences them."""
    found = sorted(offset.partition for offset in offsets)
    if (
        not found
        or len(set(found)) != len(found)
        or found[0] < 0
        or found[-1] >= partitions
        or (generations and sorted(generations) != found)
    ):
        raise InvalidRequest(
            f"a checkpoint's parts of run {run!r} need one offset for each partition written "
            f"(of {partitions}), and those are the fenced ones",
            field="offsets",
            partitions=partitions,
            given=found,
        )
    for offset in offsets:
        check_count(offset.marker, "marker")
        if offset.replay_from is not None:
            check_count(offset.replay_from, "replay_from")
            if offset.replay_from > offset.marker:
                raise InvalidRequest(
                    f"partition {offset.partition}: replay_from is after the marker",
                    field="offsets",
                    partition=offset.partition,
                )
    return found


async def write_checkpoint_parts_rows(
    conn: AsyncConnection,
    backend: Backend,
    *,
    run: str,
    checkpoint_id: int,
    replica_id: str,
    generations: Mapping[int, int],
    controller_epoch: int | None,
    offsets: Sequence[PartitionOffset],
    entries: Sequence[ManifestEntry],
    timings_ms: dict[str, float],
    marked_at: float | None,
    now: float,
    keep_committed: int,
    base_checkpoint_id: int | None = None,
    removed: Sequence[ManifestEntry] = (),
    totals: Mapping[str, int] | None = None,
) -> Checkpoint | None:
    """Write one writer's parts of a pending checkpoint (its partitions: those of ``offsets``)
    and, when every partition of the run then has a part, commit the checkpoint: the last
    writer commits, manifest-last. Returns the committed checkpoint, or None (still pending).

    Fenced by ``check_leases(replica_id, generations)`` (``generations`` name exactly the
    written partitions; empty: not fenced) and by the controller epoch: ``controller_epoch``
    when given, else the one the checkpoint was begun under must still be current.
    """
    if base_checkpoint_id is None and (removed or totals is not None):
        raise InvalidRequest("removed and totals belong to a delta manifest", field="removed")
    with collector_paused():
        columns, counts, total_bytes = manifest_columns(run, checkpoint_id, entries, removed)
    if base_checkpoint_id is not None:
        counts, total_bytes = _delta_totals(totals)
    run_row = await lock_run(conn, run, controller_epoch)
    pending = await pending_checkpoint(conn, run, checkpoint_id)
    if controller_epoch is None and pending.controller_epoch != run_row.controller_epoch:
        raise StaleController(
            f"checkpoint {checkpoint_id} of run {run!r} was begun by controller epoch "
            f"{pending.controller_epoch} (current: {run_row.controller_epoch})",
            run=run,
            controller_epoch=pending.controller_epoch,
            current_epoch=run_row.controller_epoch,
        )
    await check_leases(conn, run, replica_id, generations)
    partitions = int(run_row.partitions)
    mine = _check_offsets(run, partitions, offsets, generations)
    if not set(columns[2]) <= set(mine):
        raise InvalidRequest(
            f"a manifest entry cuts a partition of run {run!r} this writer has no offset for",
            field="entries",
        )
    if base_checkpoint_id is not None:
        based = (
            await conn.execute(
                select(manifest_chain.c.partition).where(
                    manifest_chain.c.run == run,
                    manifest_chain.c.checkpoint_id == base_checkpoint_id,
                    manifest_chain.c.depth == 0,
                    manifest_chain.c.partition.in_(mine),
                )
            )
        ).scalars()
        if len(set(based)) != len(mine):
            raise InvalidRequest(
                f"checkpoint {base_checkpoint_id} of run {run!r} is not a retained committed "
                "checkpoint of these partitions: a delta manifest cannot amend it",
                field="base_checkpoint_id",
                base_checkpoint_id=base_checkpoint_id,
            )
    written: list[int] = []
    if len(mine) < partitions:  # others write the other partitions: which did already?
        written = list(
            (
                await conn.execute(
                    select(checkpoint_parts.c.partition).where(
                        checkpoint_parts.c.run == run,
                        checkpoint_parts.c.checkpoint_id == checkpoint_id,
                    )
                )
            ).scalars()
        )
        twice = sorted(set(written) & set(mine))
        if twice:
            raise InvalidRequest(
                f"checkpoint {checkpoint_id} of run {run!r} has parts of partitions {twice} "
                "already",
                field="offsets",
                partitions=twice,
            )
    await conn.execute(
        insert(checkpoint_offsets),
        [
            {
                "run": run,
                "checkpoint_id": checkpoint_id,
                "partition": offset.partition,
                "marker_offset": offset.marker,
                "replay_from": offset.replay_from,
            }
            for offset in offsets
        ],
    )
    await backend.bulk_insert(conn, manifest_parts, MANIFEST_PART_COLUMNS, columns)
    own_totals = {**counts, "size_bytes": total_bytes}
    await conn.execute(
        insert(checkpoint_parts),
        [
            {
                "run": run,
                "checkpoint_id": checkpoint_id,
                "partition": partition,
                "replica_id": replica_id,
                "generation": generations.get(partition, 0),
                "written_at": now,
                "totals": orjson.dumps(own_totals).decode() if partition == mine[0] else None,
                "base_checkpoint_id": base_checkpoint_id,
            }
            for partition in mine
        ],
    )
    if len(written) + len(mine) < partitions:
        if marked_at is not None and pending.marked_at is None:  # the requester's: kept for
            await conn.execute(  # the committed row, whoever writes the last part
                update(checkpoints)
                .where(checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id)
                .values(marked_at=marked_at)
            )
        return None
    # The last part is in: commit, manifest-last.
    if written:
        found = (
            await conn.execute(
                select(checkpoint_parts.c.totals).where(
                    checkpoint_parts.c.run == run,
                    checkpoint_parts.c.checkpoint_id == checkpoint_id,
                    checkpoint_parts.c.totals.is_not(None),
                )
            )
        ).scalars()
        summed: Counter[str] = Counter()
        for raw in found:
            summed.update(orjson.loads(raw))
        own_totals = {name: summed[name] for name in _TOTALS}
        offsets = (await _reads.offsets_of(conn, run, [checkpoint_id]))[checkpoint_id]
    await conn.execute(_CHAIN, {"run": run, "checkpoint_id": checkpoint_id})
    marked = pending.marked_at if pending.marked_at is not None else marked_at
    entry_count = sum(own_totals[name] for name in _TOTALS[:3])
    committed = await conn.execute(
        update(checkpoints)
        .where(
            checkpoints.c.run == run,
            checkpoints.c.checkpoint_id == checkpoint_id,
            # checked above under the run's lock; said again so that no path commits twice
            checkpoints.c.status == "pending",
        )
        .values(
            status="committed",
            committed_at=now,
            marked_at=marked,
            continue_count=own_totals["continue"],
            restart_count=own_totals["restart"],
            finished_count=own_totals["finished"],
            entry_count=entry_count,
            size_bytes=own_totals["size_bytes"],
            timings_ms=orjson.dumps(timings_ms).decode() if timings_ms else None,
        )
    )
    if committed.rowcount != 1:
        raise CheckpointNotPending(
            f"checkpoint {checkpoint_id} of run {run!r} is no longer pending", run=run
        )
    await conn.execute(
        update(runs).where(runs.c.run == run).values(latest_checkpoint_id=checkpoint_id)
    )
    await _apply_retention(conn, run, keep_committed, now)
    return Checkpoint(
        run=run,
        checkpoint_id=checkpoint_id,
        status="committed",
        trigger=pending.trigger,
        controller_epoch=pending.controller_epoch,
        deadline_s=pending.deadline_s,
        requested_at=pending.requested_at,
        marked_at=marked,
        committed_at=now,
        ended_at=None,
        continue_count=own_totals["continue"],
        restart_count=own_totals["restart"],
        finished_count=own_totals["finished"],
        entry_count=entry_count,
        size_bytes=own_totals["size_bytes"],
        reason=None,
        timings_ms=timings_ms,
        offsets=tuple(sorted(offsets, key=attrgetter("partition"))),
        request_id=pending.request_id,
    )


_TOTALS = ("continue", "restart", "finished", "size_bytes")
# Each partition's chain, from its part's row: the part itself (depth 0), then the chain of its
# base's part of the same partition one deeper. One statement for every partition.
_CHAIN = text(
    "INSERT INTO manifest_chain (run, checkpoint_id, partition, depth, ancestor_id) "
    "SELECT run, checkpoint_id, partition, 0, checkpoint_id FROM checkpoint_parts "
    "WHERE run = :run AND checkpoint_id = :checkpoint_id "
    "UNION ALL SELECT p.run, p.checkpoint_id, p.partition, c.depth + 1, c.ancestor_id "
    "FROM checkpoint_parts AS p JOIN manifest_chain AS c ON c.run = p.run "
    "AND c.checkpoint_id = p.base_checkpoint_id AND c.partition = p.partition "
    "WHERE p.run = :run AND p.checkpoint_id = :checkpoint_id"
)


async def drop_checkpoint_parts(conn: AsyncConnection, run: str, checkpoint_id: int) -> None:
    """Delete what writers stored for a checkpoint that will never commit (it is aborted)."""
    for table, column in (
        (manifest_parts, manifest_parts.c.checkpoint_id),
        (checkpoint_offsets, checkpoint_offsets.c.checkpoint_id),
        (checkpoint_parts, checkpoint_parts.c.checkpoint_id),
    ):
        await conn.execute(delete(table).where(table.c.run == run, column == checkpoint_id))


def _delta_totals(totals: Mapping[str, int] | None) -> tuple[dict[str, int], int]:
    """A delta's counts of its whole (composed) manifest, which only its writer knows."""
    names = ("continue", "restart", "finished", "size_bytes")
    if totals is None or set(totals) != set(names):
        raise InvalidRequest(f"a delta manifest needs totals {names}", field="totals")
    for name in names:
        check_count(totals[name], name)
    return {name: int(totals[name]) for name in names[:3]}, int(totals["size_bytes"])


async def _apply_retention(conn: AsyncConnection, run: str, keep: int, now: float) -> None:
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


async def _current_attempts(
    conn: AsyncConnection, run: str, named: Sequence[str], into: dict[str, int]
) -> None:
    for start in range(0, len(named), 10_000):
        into.update(
            (
                await conn.execute(
                    select(episodes.c.episode, episodes.c.current_attempt).where(
                        episodes.c.run == run,
                        episodes.c.episode.in_(named[start : start + 10_000]),
                    )
                )
            ).all()
        )


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
    run_row = await lock_run(conn, run, controller_epoch)
    status = (
        await conn.execute(
            select(checkpoints.c.status).where(
                checkpoints.c.run == run, checkpoints.c.checkpoint_id == checkpoint_id
            )
        )
    ).scalar_one_or_none()
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
        manifest: dict[str, str] = {entry[0]: entry[2] for entry in compose_parts(bodies)}
    # Current attempts of the manifest's episodes (and of the plan's others, below), not of the
    # whole run, whose episodes table grows with every episode.
    current: dict[str, int] = {}
    # Episodes the checkpoint does not name (begun after its markers) may be restarted or
    # excluded, never continued: they have no cut to continue from.
    beyond = [entry.episode for entry in entries if entry.episode not in manifest]
    for named in (list(manifest), beyond):
        await _current_attempts(conn, run, named, current)
    reserved = restore_id is not None
    if restore_id is None:
        restore_id = int(run_row.last_restore_id) + 1
    else:
        await check_reserved_restore_id(conn, run, run_row, restore_id)
    counts = {"continue": 0, "restart": 0, "excluded": 0}
    rows: list[tuple[Any, ...]] = []
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
        counts[action] += 1
        rows.append(
            (
                run,
                restore_id,
                episode,
                entry.previous_attempt,
                entry.attempt,
                capture_key(episode, entry.attempt),
                action,
                entry.reason,
            )
        )
    planned_episodes = {entry.episode for entry in entries}
    missing = sorted(
        episode
        for episode, action in manifest.items()
        if action != "finished" and episode not in planned_episodes
    )
    if missing:
        raise InvalidRequest(
            f"the restore plan leaves {len(missing)} live episode(s) of checkpoint "
            f"{checkpoint_id} unaccounted for",
            episodes=missing[:20],
        )
    if not reserved:
        await conn.execute(update(runs).where(runs.c.run == run).values(last_restore_id=restore_id))
    encoded_timings = orjson.dumps(timings_ms).decode() if timings_ms else None
    await conn.execute(
        insert(restores).values(
            run=run,
            restore_id=restore_id,
            checkpoint_id=checkpoint_id,
            controller_epoch=controller_epoch,
            committed_at=now,
            continue_count=counts["continue"],
            restart_count=counts["restart"],
            excluded_count=counts["excluded"],
            timings_ms=encoded_timings,
        )
    )
    await backend.bulk_insert(
        conn, restore_episodes, RESTORE_EPISODE_COLUMNS, list(zip(*rows, strict=True)) or [[]] * 8
    )
    if entries:
        await conn.execute(_EPISODES_RESTORED, {"run": run, "restore_id": restore_id, "now": now})
    return Restore(
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
