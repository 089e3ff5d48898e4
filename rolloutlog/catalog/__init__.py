"""The SQL catalog: runs, fencing, checkpoints and manifests, restores (docs/design.md §5, §6).

``open_catalog(url)`` picks the backend by URL: ``sqlite+aiosqlite:///path`` (the embedded
default) or ``postgresql+asyncpg://user@host/db``. Every operation is one transaction; the schema
is documented for analysts in ``docs/catalog.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rolloutlog.catalog._catalog import Catalog
from rolloutlog.catalog._forks import (
    FORK_CHECKPOINT_ID,
    FORK_RESTORE_ID,
    ForkClaim,
    inherited_restore,
)
from rolloutlog.catalog._leases import ClusterView, PartitionOwner, ReplicaReport
from rolloutlog.catalog._migrate import head_revision
from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._restore_requests import RestorePart, RestorePlanning
from rolloutlog.catalog._values import (
    DEFAULT_KEEP_COMMITTED,
    DEFAULT_PARTITIONS,
    QUARANTINE_FIRST_BYTES,
    Checkpoint,
    CheckpointStatus,
    Episode,
    EpisodeFinish,
    EpisodeStart,
    EpisodeStatus,
    FinishedResult,
    ManifestAction,
    ManifestEntry,
    ParticipantKind,
    PartitionOffset,
    QuarantinedRecord,
    RegisteredParticipant,
    Restore,
    RestoreAction,
    RestoreEntry,
    Run,
    RunStats,
    RunSummary,
)

#: The name ``RestorePlanning`` had before (the REST body of a restore is ``RestoreRequest``).
RestoreRequest = RestorePlanning

__all__ = [
    "DEFAULT_KEEP_COMMITTED",
    "DEFAULT_PARTITIONS",
    "Catalog",
    "Checkpoint",
    "CheckpointStatus",
    "ClusterView",
    "Episode",
    "EpisodeFinish",
    "EpisodeStart",
    "EpisodeStatus",
    "FORK_CHECKPOINT_ID",
    "FORK_RESTORE_ID",
    "FinishedResult",
    "ForkClaim",
    "ManifestAction",
    "ManifestEntry",
    "ParticipantKind",
    "PartitionOffset",
    "PartitionOwner",
    "QUARANTINE_FIRST_BYTES",
    "QuarantinedRecord",
    "RegisteredParticipant",
    "ReplicaReport",
    "Restore",
    "RestoreAction",
    "RestoreEntry",
    "RestorePart",
    "RestorePlanning",
    "RestoreRequest",
    "Run",
    "RunStats",
    "RunSummary",
    "head_revision",
    "inherited_restore",
    "open_catalog",
]


def open_catalog(
    url: str,
    *,
    keep_committed: int = DEFAULT_KEEP_COMMITTED,
    abort_pending_on_start: bool = True,
    clock: Callable[[], float] = time.time,
) -> Catalog:
    """A catalog for ``url`` (not yet started: use ``async with`` or ``await start()``).

    ``keep_committed`` is the retention (newest N committed checkpoints keep their manifests).
    ``abort_pending_on_start=False`` is for deployments where another live replica may own a
    pending checkpoint.
    """
    return Catalog(
        backend_for(url),
        keep_committed=keep_committed,
        abort_pending_on_start=abort_pending_on_start,
        clock=clock,
    )
