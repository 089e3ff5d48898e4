"""Immutable values the catalog takes and returns.

Most are frozen dataclasses. The two that come by the ten thousand, ``ManifestEntry`` and
``RestoreEntry``, are ``NamedTuple``s: building one costs a single tuple allocation, where a
frozen dataclass pays an ``object.__setattr__`` per field, which dominated reading a
16,000-entry manifest back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from rolloutlog.core import ManifestAction as ManifestAction
from rolloutlog.core import ManifestEntry as ManifestEntry
from rolloutlog.core import PartitionOffset as PartitionOffset
from rolloutlog.core import RestoreAction as RestoreAction
from rolloutlog.core import RestoreEntry as RestoreEntry
from rolloutlog.log import DEFAULT_PARTITIONS as DEFAULT_PARTITIONS
from rolloutlog.log import ParticipantKind as ParticipantKind
from rolloutlog.log import capture_key as capture_key

CheckpointStatus = Literal["pending", "committed", "aborted", "expired"]
EpisodeStatus = Literal["running", "finished", "excluded"]

PARTICIPANT_KINDS: frozenset[str] = frozenset({"environment", "policy", "agent", "resources"})
CHECKPOINT_STATUSES: frozenset[str] = frozenset({"pending", "committed", "aborted", "expired"})
MANIFEST_ACTIONS: frozenset[str] = frozenset({"continue", "restart", "finished"})
RESTORE_ACTIONS: frozenset[str] = frozenset({"continue", "restart", "excluded"})
EPISODE_STATUSES: frozenset[str] = frozenset({"running", "finished", "excluded"})

DEFAULT_KEEP_COMMITTED = 2

#: The action of a packed tombstone: a delta manifest's mark of an episode its base named and it
#: does not (never read back: the composition drops it).
REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class Run:
    """A run's settings and its fencing state."""

    run: str
    partitions: int
    log_url: str | None
    controller_epoch: int
    latest_checkpoint_id: int | None
    created_at: float
    #: A fork's source run and checkpoint, and when it was created (None: no fork).
    forked_from_run: str | None = None
    forked_from_checkpoint: int | None = None
    forked_at: float | None = None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run with the counts an analyst's run list shows."""

    run: Run
    participant_count: int
    checkpoint_counts: Mapping[str, int]
    restore_count: int
    episode_count: int


@dataclass(frozen=True, slots=True)
class RegisteredParticipant:
    run: str
    participant_id: str
    kind: ParticipantKind
    epoch: int
    registered_at: float
    last_seen_at: float


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint's catalog row with its per-partition offsets."""

    run: str
    checkpoint_id: int
    status: CheckpointStatus
    trigger: str
    controller_epoch: int
    deadline_s: float | None
    requested_at: float
    marked_at: float | None
    committed_at: float | None
    ended_at: float | None
    continue_count: int
    restart_count: int
    finished_count: int
    entry_count: int
    size_bytes: int
    reason: str | None
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    offsets: tuple[PartitionOffset, ...] = ()
    #: The client's id of the request this checkpoint answers (None: it named none).
    request_id: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        """``{"continue", "restart", "finished"}`` as in the REST reply."""
        return {
            "continue": self.continue_count,
            "restart": self.restart_count,
            "finished": self.finished_count,
        }


@dataclass(frozen=True, slots=True)
class Restore:
    run: str
    restore_id: int
    checkpoint_id: int
    controller_epoch: int
    committed_at: float
    continue_count: int
    restart_count: int
    excluded_count: int
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    #: Finished results not acknowledged when the restore committed (set by the commit only).
    unacknowledged_results: int | None = None

    @property
    def counts(self) -> dict[str, int]:
        """``{"continue", "restart", "excluded"}`` as in the REST reply."""
        return {
            "continue": self.continue_count,
            "restart": self.restart_count,
            "excluded": self.excluded_count,
        }


@dataclass(frozen=True, slots=True)
class EpisodeStart:
    """Where an episode's first event landed, as the projector saw it."""

    episode: str
    partition: int
    offset: int
    started_at: float


@dataclass(frozen=True, slots=True)
class EpisodeFinish:
    """An attempt's ``episode.finished`` event, as the projector saw it.

    With ``partition`` and ``offset`` given, the catalog also keeps the attempt's result
    (``reward`` and the opaque ``result``'s raw JSON) for the trainer (``FinishedResult``).
    """

    episode: str
    attempt: int
    finished_at: float
    partition: int | None = None
    offset: int | None = None
    reward: float | None = None
    result: bytes | None = None


@dataclass(frozen=True, slots=True)
class FinishedResult:
    """A finished attempt's result as the catalog keeps it until (and after) the trainer
    acknowledges it: ``result`` is the opaque payload's raw JSON (None when it had none)."""

    episode: str
    attempt: int
    partition: int
    finished_offset: int
    ts: float
    reward: float | None
    result: bytes | None
    acknowledged_at: float | None

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.attempt)


@dataclass(frozen=True, slots=True)
class QuarantinedRecord:
    """A log record the projector skipped: not a valid envelope, or the fold could not apply it."""

    partition: int
    offset: int
    reason: str
    size: int
    #: The record's first bytes (at most ``QUARANTINE_FIRST_BYTES``), for an operator to look at.
    first_bytes: bytes
    recorded_at: float = 0.0


#: How many of a quarantined record's first bytes the catalog keeps.
QUARANTINE_FIRST_BYTES = 256


@dataclass(frozen=True, slots=True)
class Episode:
    run: str
    episode: str
    current_attempt: int
    status: EpisodeStatus
    first_partition: int | None
    first_offset: int | None
    started_at: float | None
    finished_at: float | None
    updated_at: float
    #: In a fork: the attempt the episode had in the source at the fork (None otherwise).
    forked_attempt: int | None = None

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.current_attempt)


@dataclass(frozen=True, slots=True)
class RunStats:
    """Catalog-side statistics of one run (event counts live in the log)."""

    run: str
    participant_count: int
    checkpoint_counts: Mapping[str, int]
    episode_counts: Mapping[str, int]
    restore_count: int
    latest_checkpoint_id: int | None
    latest_entry_count: int
    latest_size_bytes: int
    checkpoint_duration_ms_mean: float | None
    checkpoint_duration_ms_max: float | None
    checkpoint_duration_ms_last: float | None
    last_restore_at: float | None
