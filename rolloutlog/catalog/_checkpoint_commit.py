"""A checkpoint's parts and its commit: one writer's manifest parts, offsets and ``checkpoint_parts``
rows in one transaction, and the commit (manifest-last) when the last part is in."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import orjson
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import _reads
from rolloutlog.catalog._backend import Backend
from rolloutlog.catalog._leases import check_leases
from rolloutlog.catalog._schema import (
    NAME_LENGTH,
    checkpoint_offsets,
    checkpoint_parts,
    checkpoints,
    manifest_chain,
    manifest_parts,
    runs,
)
from rolloutlog.catalog._validate import check_count, check_episode
from rolloutlog.catalog._values import REMOVED, Checkpoint, ManifestEntry, PartitionOffset
from rolloutlog.catalog._writes import apply_retention, lock_run, pending_checkpoint
from rolloutlog.errors import CheckpointNotPending, InvalidRequest, StaleController

MANIFEST_PART_COLUMNS = ("run", "checkpoint_id", "cut_partition", "entries", "entry_count")


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


@dataclass(frozen=True, slots=True)
class CheckpointParts:
    """One writer's parts of a pending checkpoint, as ``write_checkpoint_parts_rows`` takes them.

    ``offsets``: one per partition written (exactly those of ``generations``, which
    ``check_leases`` fences for ``replica_id``; empty: not fenced). ``entries``: the manifest
    of those partitions, whole, or with ``base_checkpoint_id`` a delta of that retained
    committed checkpoint's (``removed``: the base's entries of episodes it no longer names;
    ``totals``: the counts of these partitions' whole manifest). ``controller_epoch``: the
    writer's, checked when given; else the one the checkpoint was begun under must be current.
    """

    run: str
    checkpoint_id: int
    offsets: Sequence[PartitionOffset]
    entries: Sequence[ManifestEntry]
    replica_id: str = ""
    generations: Mapping[int, int] = field(default_factory=dict)
    controller_epoch: int | None = None
    timings_ms: Mapping[str, float] | None = None
    marked_at: float | None = None
    base_checkpoint_id: int | None = None
    removed: Sequence[ManifestEntry] = ()
    totals: Mapping[str, int] | None = None


async def write_checkpoint_parts_rows(
    conn: AsyncConnection,
    backend: Backend,
    parts: CheckpointParts,
    *,
    now: float,
    keep_committed: int,
) -> Checkpoint | None:
    """Write one writer's parts of a pending checkpoint (its partitions: those of ``offsets``)
    and, when every partition of the run then has a part, commit the checkpoint: the last
    writer commits, manifest-last. Returns the committed checkpoint, or None (still pending).

    Fenced by ``check_leases(replica_id, generations)`` and by the controller epoch (see
    ``CheckpointParts``).
    """
    columns, own_totals = _encode(parts)
    run_row, pending = await _fence(conn, parts)
    partitions = int(run_row.partitions)
    mine = _check_offsets(parts.run, partitions, parts.offsets, parts.generations)
    if not set(columns[2]) <= set(mine):
        raise InvalidRequest(
            f"a manifest entry cuts a partition of run {parts.run!r} this writer has no offset for",
            field="entries",
        )
    if parts.base_checkpoint_id is not None:
        await _check_base(conn, parts, mine)
    written = await _written_before(conn, parts, mine) if len(mine) < partitions else []
    await _insert_parts(conn, backend, parts, mine, columns, own_totals, now)
    if len(written) + len(mine) < partitions:
        if parts.marked_at is not None and pending.marked_at is None:  # the requester's: kept
            await conn.execute(  # for the committed row, whoever writes the last part
                update(checkpoints)
                .where(*_this_checkpoint(parts))
                .values(marked_at=parts.marked_at)
            )
        return None
    # The last part is in: commit, manifest-last.
    offsets: Sequence[PartitionOffset] = parts.offsets
    if written:
        own_totals = await _summed_totals(conn, parts)
        offsets = (await _reads.offsets_of(conn, parts.run, [parts.checkpoint_id]))[
            parts.checkpoint_id
        ]
    return await _commit(conn, parts, pending, own_totals, offsets, now, keep_committed)


def _this_checkpoint(parts: CheckpointParts) -> tuple[Any, Any]:
    """The ``checkpoints`` row's condition."""
    return checkpoints.c.run == parts.run, checkpoints.c.checkpoint_id == parts.checkpoint_id


def _encode(parts: CheckpointParts) -> tuple[list[Sequence[Any]], dict[str, int]]:
    """The parts' ``manifest_parts`` columns and their counts (``_TOTALS``), checked before
    any lock is taken."""
    if parts.base_checkpoint_id is None and (parts.removed or parts.totals is not None):
        raise InvalidRequest("removed and totals belong to a delta manifest", field="removed")
    with collector_paused():
        columns, counts, total_bytes = manifest_columns(
            parts.run, parts.checkpoint_id, parts.entries, parts.removed
        )
    if parts.base_checkpoint_id is not None:
        counts, total_bytes = _delta_totals(parts.totals)
    return columns, {**counts, "size_bytes": total_bytes}


async def _fence(conn: AsyncConnection, parts: CheckpointParts) -> tuple[Any, Any]:
    """Lock the run; check the controller epoch, that the checkpoint is pending and the
    writer's leases. Returns (the run's row, the checkpoint's)."""
    run, checkpoint_id = parts.run, parts.checkpoint_id
    run_row = await lock_run(conn, run, parts.controller_epoch)
    pending = await pending_checkpoint(conn, run, checkpoint_id)
    if parts.controller_epoch is None and pending.controller_epoch != run_row.controller_epoch:
        raise StaleController(
            f"checkpoint {checkpoint_id} of run {run!r} was begun by controller epoch "
            f"{pending.controller_epoch} (current: {run_row.controller_epoch})",
            run=run,
            controller_epoch=pending.controller_epoch,
            current_epoch=run_row.controller_epoch,
        )
    await check_leases(conn, run, parts.replica_id, parts.generations)
    return run_row, pending


async def _check_base(conn: AsyncConnection, parts: CheckpointParts, mine: list[int]) -> None:
    """A delta's base must be a retained committed checkpoint of every partition written."""
    based = (
        await conn.execute(
            select(manifest_chain.c.partition).where(
                manifest_chain.c.run == parts.run,
                manifest_chain.c.checkpoint_id == parts.base_checkpoint_id,
                manifest_chain.c.depth == 0,
                manifest_chain.c.partition.in_(mine),
            )
        )
    ).scalars()
    if len(set(based)) != len(mine):
        raise InvalidRequest(
            f"checkpoint {parts.base_checkpoint_id} of run {parts.run!r} is not a retained "
            "committed checkpoint of these partitions: a delta manifest cannot amend it",
            field="base_checkpoint_id",
            base_checkpoint_id=parts.base_checkpoint_id,
        )


async def _written_before(
    conn: AsyncConnection, parts: CheckpointParts, mine: list[int]
) -> list[int]:
    """The partitions other writers wrote parts of already (none of them ``mine``)."""
    written = list(
        (
            await conn.execute(
                select(checkpoint_parts.c.partition).where(
                    checkpoint_parts.c.run == parts.run,
                    checkpoint_parts.c.checkpoint_id == parts.checkpoint_id,
                )
            )
        ).scalars()
    )
    twice = sorted(set(written) & set(mine))
    if twice:
        raise InvalidRequest(
            f"checkpoint {parts.checkpoint_id} of run {parts.run!r} has parts of partitions "
            f"{twice} already",
            field="offsets",
            partitions=twice,
        )
    return written


async def _insert_parts(
    conn: AsyncConnection,
    backend: Backend,
    parts: CheckpointParts,
    mine: list[int],
    columns: list[Sequence[Any]],
    own_totals: Mapping[str, int],
    now: float,
) -> None:
    """The writer's offsets, packed manifest parts and ``checkpoint_parts`` rows (its counts
    on its first partition's)."""
    run, checkpoint_id = parts.run, parts.checkpoint_id
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
            for offset in parts.offsets
        ],
    )
    await backend.bulk_insert(conn, manifest_parts, MANIFEST_PART_COLUMNS, columns)
    await conn.execute(
        insert(checkpoint_parts),
        [
            {
                "run": run,
                "checkpoint_id": checkpoint_id,
                "partition": partition,
                "replica_id": parts.replica_id,
                "generation": parts.generations.get(partition, 0),
                "written_at": now,
                "totals": orjson.dumps(own_totals).decode() if partition == mine[0] else None,
                "base_checkpoint_id": parts.base_checkpoint_id,
            }
            for partition in mine
        ],
    )


async def _summed_totals(conn: AsyncConnection, parts: CheckpointParts) -> dict[str, int]:
    """The counts of every writer's parts, summed."""
    found = (
        await conn.execute(
            select(checkpoint_parts.c.totals).where(
                checkpoint_parts.c.run == parts.run,
                checkpoint_parts.c.checkpoint_id == parts.checkpoint_id,
                checkpoint_parts.c.totals.is_not(None),
            )
        )
    ).scalars()
    summed: Counter[str] = Counter()
    for raw in found:
        summed.update(orjson.loads(raw))
    return {name: summed[name] for name in _TOTALS}


async def _commit(
    conn: AsyncConnection,
    parts: CheckpointParts,
    pending: Any,
    totals: Mapping[str, int],
    offsets: Sequence[PartitionOffset],
    now: float,
    keep_committed: int,
) -> Checkpoint:
    """Chain the parts, mark the checkpoint committed and the run's latest, apply retention."""
    run, checkpoint_id = parts.run, parts.checkpoint_id
    timings_ms = dict(parts.timings_ms or {})
    await conn.execute(_CHAIN, {"run": run, "checkpoint_id": checkpoint_id})
    committed: dict[str, Any] = {
        "status": "committed",
        "committed_at": now,
        "marked_at": pending.marked_at if pending.marked_at is not None else parts.marked_at,
        "continue_count": totals["continue"],
        "restart_count": totals["restart"],
        "finished_count": totals["finished"],
        "entry_count": sum(totals[name] for name in _TOTALS[:3]),
        "size_bytes": totals["size_bytes"],
    }
    done = await conn.execute(
        update(checkpoints)
        # checked above under the run's lock; said again so that no path commits twice
        .where(*_this_checkpoint(parts), checkpoints.c.status == "pending")
        .values(**committed, timings_ms=_reads.encode_json_map(timings_ms))
    )
    if done.rowcount != 1:
        raise CheckpointNotPending(
            f"checkpoint {checkpoint_id} of run {run!r} is no longer pending", run=run
        )
    await conn.execute(
        update(runs).where(runs.c.run == run).values(latest_checkpoint_id=checkpoint_id)
    )
    await apply_retention(conn, run, keep_committed, now)
    return dataclasses.replace(
        _reads.checkpoint_from_row(pending, sorted(offsets, key=attrgetter("partition"))),
        **committed,
        timings_ms=timings_ms,
        reason=None,
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


def _delta_totals(totals: Mapping[str, int] | None) -> tuple[dict[str, int], int]:
    """A delta's counts of its whole (composed) manifest, which only its writer knows."""
    names = ("continue", "restart", "finished", "size_bytes")
    if totals is None or set(totals) != set(names):
        raise InvalidRequest(f"a delta manifest needs totals {names}", field="totals")
    for name in names:
        check_count(totals[name], name)
    return {name: int(totals[name]) for name in names[:3]}, int(totals["size_bytes"])
