"""A capture as the catalog stores it (docs/design.md §10 "A checkpoint", "Manifests"): its
partitions' offsets and entries, whole or as a delta over the base's manifest (``delta_of``),
the manifest's counts and staging keys kept as entries change, and the owner's one write of its
parts (``write_parts``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

from rolloutlog.catalog import Catalog, Checkpoint, ManifestEntry, PartitionOffset
from rolloutlog.projections._capture import CheckpointCapture
from rolloutlog.projections._feeders import flush_episodes
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._timing import StageTimer

__all__ = [
    "MAX_CHAIN_DEPTH",
    "Delta",
    "StagingDelta",
    "delta_of",
    "end_committed",
    "manifest_of",
    "staging_keys",
    "write_parts",
]

_STAGING_KEYS = attrgetter("staging_keys")
_ACTION = itemgetter(2)
_SIZE = itemgetter(7)


@dataclass(frozen=True, slots=True)
class StagingDelta:
    """How a checkpoint's staging keys differ from those of checkpoint ``since`` (its base):
    ``count`` keys in all."""

    since: int
    added: tuple[str, ...]
    removed: tuple[str, ...]
    count: int


def staging_keys(manifest: Iterable[ManifestEntry]) -> tuple[str, ...]:
    """Every staging key the manifest's entries reference, each once, in order."""
    return tuple(dict.fromkeys(chain.from_iterable(map(_STAGING_KEYS, manifest))))


async def write_parts(
    catalog: Catalog,
    replica_id: str,
    projector: Projector,
    capture: CheckpointCapture,
    timer: StageTimer,
    controller_epoch: int | None,
    marked_at: float | None,
    written: frozenset[int] = frozenset(),
) -> tuple[Checkpoint | None, Delta | None, StagingDelta | None]:
    """Write the capture's parts (one transaction); the checkpoint if that committed it,
    the delta manifest written (None: whole), how the staging keys changed from the base's.
    ``written``: partitions that have their part already (their owner before this
    projector's start wrote it), left out of the write."""
    if not capture.owned:  # a replica that owns none of the run's partitions
        return None, None, None
    projector.check_running()  # a run whose log was lost meanwhile commits nothing
    offsets, entries = manifest_of(capture)
    delta, restaged = delta_of(capture, entries)
    keep = capture.owned - written
    whole = list((capture.whole or {}).values()) if delta is None else []
    if keep != capture.owned:  # the rest's parts, whole (a delta's totals span them all)
        if not keep:
            return None, None, None
        offsets = [offset for offset in offsets if offset.partition in keep]
        whole = [e for e in (capture.whole or {}).values() if e.cut_partition in keep]
        delta = None
    # Every finish below the markers is in the catalog before they commit: a restarted
    # projector reads from the new cut on, and would never record it.
    await flush_episodes(catalog, projector, finishes_only=True)
    timer.stage("manifest")
    generations = {p: g for p, g in projector.generations.items() if p in keep}
    write = catalog.write_checkpoint_parts
    common: dict[str, Any] = {
        "replica_id": replica_id,
        "generations": generations,
        "controller_epoch": controller_epoch,
        "timings_ms": timer.total(),
        "marked_at": marked_at,
    }
    run, checkpoint_id = projector.run, capture.checkpoint_id
    if delta is None:
        return await write(run, checkpoint_id, offsets, whole, **common), None, restaged
    committed = await write(
        run,
        checkpoint_id,
        offsets,
        delta.changed,
        base_checkpoint_id=delta.base,
        removed=delta.removed,
        totals=delta.totals,
        **common,
    )
    return committed, delta, restaged


def end_committed(projector: Projector, capture: CheckpointCapture, delta: Delta | None) -> None:
    """The checkpoint committed: the projector's next manifest amends this one."""
    if delta is None:
        projector.end_capture(capture, committed=True)
    else:
        projector.end_capture(capture, committed=True, depth=delta.depth, amended=delta.amended)


#: A chain of delta manifests is at most this many deltas long: the next manifest is whole.
MAX_CHAIN_DEPTH = 16


@dataclass(frozen=True, slots=True)
class Delta:
    """A manifest written as the changes to its base's (``base``), ``depth`` deltas after a
    whole one, ``amended`` entries written in those deltas."""

    base: int
    changed: list[ManifestEntry]
    removed: list[ManifestEntry]
    totals: dict[str, int]
    depth: int
    amended: int


def delta_of(
    capture: CheckpointCapture, entries: list[ManifestEntry]
) -> tuple[Delta | None, StagingDelta | None]:
    """What the manifest changes from its base's (None: write it whole, ``capture.whole``).
    ``entries`` are the capture's: every live episode's without a base, else those whose
    trackers changed. Whole when there is no base, when the chain is ``MAX_CHAIN_DEPTH`` deltas
    long, or when its deltas would amend at least half as many entries as it holds: a read
    composes at most 1.5x the manifest's entries, and a whole manifest's cost is spread over
    the deltas before it. Sets ``capture.totals`` and ``capture.staging`` either way, from
    what changed; with a base, also returns the staging keys that came and went since it."""
    base = capture.base
    if base is None:
        whole = capture.compose()
        capture.staging = Counter(chain.from_iterable(map(_STAGING_KEYS, entries)))
        counts = Counter(map(_ACTION, entries))
        capture.totals = {
            **{action: counts[action] for action in ("continue", "restart", "finished")},
            "size_bytes": sum(map(_SIZE, entries)),
        }
        return None, None
    # Counts and staging references follow what changed (before ``compose`` amends the base).
    before = base.entries
    replaced = [before[episode] for episode in capture.entries if episode in before]
    removed = [before[episode] for episode in capture.gone if episode in before]
    totals, staging = dict(base.totals), base.staging
    dropped: set[str] = set()
    for entry in chain(replaced, removed):
        totals[entry[2]] -= 1
        totals["size_bytes"] -= entry[7]
        for key in entry[6]:
            if staging[key] > 1:
                staging[key] -= 1
            else:
                del staging[key]
                dropped.add(key)
    added: list[str] = []
    for entry in entries:
        totals[entry[2]] += 1
        totals["size_bytes"] += entry[7]
        for key in entry[6]:
            count = staging.get(key, 0)
            staging[key] = count + 1
            if not count:
                if key in dropped:  # referenced before and after: no change
                    dropped.discard(key)
                else:
                    added.append(key)
    capture.totals, capture.staging = totals, staging
    restaged = StagingDelta(base.checkpoint_id, tuple(added), tuple(dropped), len(staging))
    whole = capture.compose()
    amended = base.amended + len(entries) + len(removed)
    if base.depth >= MAX_CHAIN_DEPTH or 2 * amended >= len(whole):
        return None, restaged
    delta = Delta(base.checkpoint_id, entries, removed, totals, base.depth + 1, amended)
    return delta, restaged


def manifest_of(capture: CheckpointCapture) -> tuple[list[PartitionOffset], list[ManifestEntry]]:
    offsets = [
        PartitionOffset(partition, marker, min(capture.needed.get(partition, marker), marker))
        for partition, marker in sorted(capture.markers.items())
    ]
    entries = capture.entries
    for episode, reason in capture.reasons.items():  # restarts only: a few, not every entry
        entry = entries.get(episode)
        if entry is not None and entry.action == "restart":
            entries[episode] = entry._replace(reason=reason)
    return offsets, list(entries.values())
