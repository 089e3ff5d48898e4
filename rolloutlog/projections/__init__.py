"""Projections: the pure fold of an episode's events, the projector, checkpoints and restores."""

from rolloutlog.core import (
    CUT_DISPOSITIONS,
    BoundaryView,
    EpisodeProjection,
    GenerationCut,
    LedgerEntry,
    ProjectionLine,
    ProjectionStatus,
    SessionView,
    served_cut_dispositions,
)
from rolloutlog.projections._checkpointer import CheckpointResult
from rolloutlog.projections._coordinator import Coordinator, TrackedEpisode
from rolloutlog.projections._fold import (
    EpisodeFold,
    RecordView,
    ledger_digest,
    project_episode,
    project_events,
    select_records,
    token_count,
)
from rolloutlog.projections._fork import ForkRequest, ForkResult
from rolloutlog.projections._health import Blocker, BlockerState, RunHealthReport
from rolloutlog.projections._health import summarize as summarize_health
from rolloutlog.projections._ownership import DEFAULT_LEASE_S, default_replica_id
from rolloutlog.projections._restorer import RestoreResult

__all__ = [
    "Blocker",
    "BlockerState",
    "BoundaryView",
    "CUT_DISPOSITIONS",
    "CheckpointResult",
    "DEFAULT_LEASE_S",
    "Coordinator",
    "ForkRequest",
    "ForkResult",
    "RestoreResult",
    "RunHealthReport",
    "TrackedEpisode",
    "EpisodeFold",
    "EpisodeProjection",
    "ProjectionLine",
    "ProjectionStatus",
    "GenerationCut",
    "LedgerEntry",
    "RecordView",
    "SessionView",
    "default_replica_id",
    "ledger_digest",
    "project_episode",
    "project_events",
    "select_records",
    "served_cut_dispositions",
    "summarize_health",
    "token_count",
]
