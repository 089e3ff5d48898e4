"""Request and response bodies of the REST contract (docs/design.md §8), as documented in OpenAPI.

Requests are validated strictly (no type coercion, no unknown fields, no NaN). Responses are
built as dicts and encoded with orjson; the response models here document their shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field

from rolloutlog.log import MAX_PARTITIONS, NAME_PATTERN
from rolloutlog.projections import BlockerState

__all__ = [
    "AppendOut",
    "CheckpointList",
    "CheckpointOut",
    "CheckpointRequest",
    "ControllerOut",
    "ControllerRequest",
    "CreateRun",
    "EpisodeHistoryOut",
    "EpisodeList",
    "EpisodeOut",
    "ErrorOut",
    "ForkSpec",
    "EventOut",
    "ManifestOut",
    "ParticipantList",
    "ParticipantOut",
    "ProjectionOut",
    "ProjectorOut",
    "RegisterParticipant",
    "Responses",
    "RestoreDetail",
    "RestoreEpisodes",
    "RestoreList",
    "RestoreOut",
    "RestoreRequest",
    "RunList",
    "RunOut",
    "StatsOut",
]

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
RunName = Annotated[str, Field(pattern=RUN_PATTERN, examples=["run-1"])]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Count = Annotated[int, Field(ge=0, le=2**62)]
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
ParticipantKind = Literal["environment", "policy", "agent", "resources"]
#: The ``responses=`` of a route decorator (documented error replies).
Responses = dict[int | str, dict[str, Any]]
RunPath = Annotated[str, Path(pattern=RUN_PATTERN, description="The run's name.")]
EpisodePath = Annotated[str, Path(pattern=NAME_PATTERN, description="An episode id.")]
IdPath = Annotated[int, Path(ge=0, le=2**62)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- requests ----------------------------------------------------------------------------------


class ForkSpec(_Request):
    """Create the run as a fork of ``run``'s committed checkpoint: its live episodes (only
    ``episodes`` when given) minus ``exclude``."""

    run: RunName
    checkpoint_id: Count | Literal["latest"] = "latest"
    episodes: Annotated[list[Name], Field(min_length=1, max_length=1_000_000)] | None = None
    exclude: Annotated[list[Name], Field(max_length=1_000_000)] = []


class CreateRun(_Request):
    run: RunName
    partitions: Annotated[int, Field(ge=1, le=MAX_PARTITIONS)] | None = None
    fork: ForkSpec | None = None


class RegisterParticipant(_Request):
    id: Name
    kind: ParticipantKind


class ControllerRequest(_Request):
    """Take over the run's controller; with ``expected_epoch`` only if it is still current."""

    expected_epoch: Count | None = None


class CheckpointRequest(_Request):
    controller_epoch: Count
    deadline_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    wait: bool = True
    trigger: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")] = "request"
    #: The requester holds this checkpoint's ``staging_keys``: the reply may say what changed
    #: from them (``staging_keys_added``/``_removed``) instead of listing them all.
    staging_keys_since: Count | None = None
    #: The client's id of this request (sending it again after no answer came is safe): kept
    #: on the checkpoint it begins; a request naming one that committed is answered with it
    #: (201), pending with it when ``wait`` is false (202), else ``checkpoint_in_progress``
    #: while its requester lives. ``GET …/checkpoints?request_id=`` finds it. None: none.
    request_id: RequestId | None = None


class RestoreRequest(_Request):
    controller_epoch: Count
    checkpoint_id: Count | Literal["latest"]
    exclude: Annotated[list[Name], Field(max_length=1_000_000)] = []
    policy_version: Count | None = None
    max_policy_lag: Count | None = None
    #: Also exclude the episodes whose finished result the service holds (``GET …/results``).
    exclude_results: bool = False


# -- responses ---------------------------------------------------------------------------------


class ErrorBody(_Response):
    code: str
    message: str
    details: dict[str, Any]


class ErrorOut(_Response):
    error: ErrorBody


class LocalHealthOut(_Response):
    """This replica's own projector of the run: ``ok``, ``degraded`` (it hit ``error`` and
    retries: it recovers by itself) or ``stopped`` (its log lost records: an operator must
    act). ``since``: unix time."""

    status: Literal["ok", "degraded", "stopped"]
    error: str | None = None
    since: float


class BlockerOut(_Response):
    """A partition that holds the run back and the replica that holds it (null: nobody)."""

    partition: int
    replica: str | None = None
    state: BlockerState
    reason: str
    since: float | None = None
    #: Records of the partition its owner has not applied yet (while catching up or degraded).
    lag: int | None = None


class RunHealthOut(_Response):
    """The run's health across replicas, the same whichever replica answers: ``ok`` when no
    partition holds it back, else ``degraded`` (it recovers by itself) or ``stopped`` (an
    operator must act), with ``held_back`` naming each partition and the replica that holds it.
    ``local``: this replica's own projector of the run (null: it does not follow the run);
    ``replica``: the answering replica's id; ``cluster_unknown``: why the other replicas'
    reports could not be read (null when they were). ``since``: unix time."""

    status: Literal["ok", "degraded", "stopped"]
    error: str | None = None
    since: float | None = None
    replica: str | None = None
    local: LocalHealthOut | None = None
    held_back: list[BlockerOut] = []
    cluster_unknown: str | None = None


class ForkedFromOut(_Response):
    run: str | None
    checkpoint_id: int | None
    at: float | None


class ForkOut(_Response):
    run: str
    checkpoint_id: int | None
    at: float | None


class RunOut(_Response):
    run: str
    partitions: int
    #: A fork's source (None: the run is no fork; its ``run`` None: out of the token's
    #: scope); a source's forks the token reads (``GET …/runs/{run}``).
    forked_from: ForkedFromOut | None = None
    forks: list[ForkOut] | None = None
    #: A fork's creation reply: every staging key its checkpoint 1 references (null once that
    #: checkpoint is no longer kept), as a checkpoint's reply lists them.
    staging_keys: list[str] | None = None
    log_url: str | None = None
    controller_epoch: int = 0
    latest_checkpoint_id: int | None = None
    created_at: float | None = None
    counts: dict[str, Any] = {}
    health: RunHealthOut | None = None


class DeletedRunOut(_Response):
    run: str
    deleted: bool


class RunList(_Response):
    runs: list[RunOut]
    next_after: str | None = None


class ParticipantOut(_Response):
    id: str
    kind: ParticipantKind
    epoch: int


class ParticipantList(_Response):
    participants: list[ParticipantOut]


class PositionOut(_Response):
    partition: int
    offset: int


class AppendOut(_Response):
    offsets: list[PositionOut]


class ControllerOut(_Response):
    controller_epoch: int


class CheckpointCounts(_Response):
    continue_: int = Field(alias="continue")
    restart: int
    finished: int


class CheckpointOffset(_Response):
    partition: int
    marker: int
    replay_from: int | None


class CheckpointOut(_Response):
    checkpoint_id: int
    status: Literal["pending", "committed", "aborted", "expired"]
    counts: CheckpointCounts
    offsets: list[CheckpointOffset]
    staging_keys: list[str] | None = None
    #: Instead of ``staging_keys`` (a request's ``staging_keys_since``): what changed from that
    #: checkpoint's, and how many keys there are now.
    staging_keys_since: int | None = None
    staging_keys_added: list[str] | None = None
    staging_keys_removed: list[str] | None = None
    staging_key_count: int | None = None
    timings_ms: dict[str, float]
    trigger: str | None = None
    controller_epoch: int | None = None
    requested_at: float | None = None
    committed_at: float | None = None
    reason: str | None = None
    request_id: str | None = None


class CheckpointList(_Response):
    checkpoints: list[CheckpointOut]


class Cut(_Response):
    partition: int
    offset: int


class ManifestEntryOut(_Response):
    episode: str
    attempt: int
    capture_key: str
    action: Literal["continue", "restart", "finished"]
    cut: Cut
    last_stage: str | None = None


class ManifestOut(_Response):
    checkpoint_id: int
    episodes: list[ManifestEntryOut]


class RestoreCounts(_Response):
    continue_: int = Field(alias="continue")
    restart: int
    excluded: int


class RestoreOut(_Response):
    restore_id: int
    checkpoint_id: int
    counts: RestoreCounts
    controller_epoch: int | None = None
    committed_at: float | None = None
    timings_ms: dict[str, float] = {}
    #: Finished results not acknowledged yet (the reply of a new restore only).
    unacknowledged_results: int | None = None


class RestoreEpisodeOut(_Response):
    episode: str
    previous_attempt: int
    attempt: int
    capture_key: str
    action: Literal["continue", "restart", "excluded"]
    reason: str | None = None


class RestoreDetail(RestoreOut):
    episodes: list[RestoreEpisodeOut]


class RestoreEpisodes(_Response):
    episodes: list[RestoreEpisodeOut]


class RestoreList(_Response):
    restores: list[RestoreOut]


class EpisodeOut(_Response):
    episode: str
    current_attempt: int
    capture_key: str
    status: Literal["running", "finished", "excluded"]
    live: bool
    first_partition: int | None = None
    first_offset: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float | None = None


class EpisodeList(_Response):
    episodes: list[EpisodeOut]
    next_after: str | None = None


class BoundaryOut(_Response):
    stage: str
    next: str | None
    state: Any
    step: int | None


class SessionOut(_Response):
    kind: str
    participant: str
    mode: str
    verify: str
    state: Any


class ProjectionOut(_Response):
    """One episode's projection at its cut (opaque states are passed through as logged)."""

    episode: str
    attempt: int
    capture_key: str
    status: str | None = None
    task: Any
    task_digest: str | None
    boundaries: dict[str, BoundaryOut]
    sessions: dict[str, SessionOut]
    ledger: list[dict[str, Any]]
    generation_cut: dict[str, Any] | None


class StatsOut(_Response):
    run: str
    events: dict[str, Any]
    episodes: dict[str, Any]
    checkpoints: dict[str, Any]
    restores: dict[str, Any]
    participants: int


class Health(_Response):
    """``status`` (and the status code) is this replica's own readiness; ``runs`` says, per
    run, what holds it back on any replica."""

    status: str
    replica: str | None = None
    log: str | None = None
    catalog: str | None = None
    runs: dict[str, RunHealthOut] = {}
    checks: dict[str, str] = {}


class QuarantinedOut(_Response):
    partition: int
    offset: int
    reason: str
    size: int
    #: The record's first bytes (at most 256), as text with undecodable bytes replaced.
    first_bytes: str
    recorded_at: float


class QuarantineList(_Response):
    records: list[QuarantinedOut]
    next_after: str | None = None


# -- analysts' reads ----------------------------------------------------------------


class TimelineEventOut(_Response):
    """One event of an episode's timeline: its metadata, never its payload."""

    offset: int
    type: str
    attempt: int
    step: int | None = None
    participant: str | None = None
    kind: str | None = None
    stage: str | None = None
    size_bytes: int
    payload_bytes: int
    data: dict[str, Any]


class AttemptOut(_Response):
    attempt: int
    capture_key: str
    events: int
    why: str
    restore_id: int | None = None
    checkpoint_id: int | None = None
    action: str | None = None
    resumed_from: dict[str, Any] | None = None
    #: In a fork: whether the attempt happened in the source run, before the fork.
    in_source: bool | None = None


class EpisodeHistoryOut(_Response):
    """An episode across attempts: why each began, what every kept checkpoint's manifest and
    every restore's plan said of it, and its events (paged with ``after=next_after``)."""

    run: str
    episode: str
    partition: int
    status: str | None
    current_attempt: int
    #: In a fork: the source run, checkpoint and the attempt the episode had there; its
    #: attempts up to that one happened in the source (``in_source``). Its ``run`` is None
    #: to a token that holds no role on the source.
    forked_from: dict[str, Any] | None = None
    attempts: list[AttemptOut]
    checkpoints: list[ManifestEntryOut]
    restores: list[RestoreEpisodeOut]
    ledger: list[dict[str, Any]]
    generation_calls: list[dict[str, Any]]
    event_count: int
    events: list[TimelineEventOut]
    next_after: int | None = None
    #: Its finished result as the trainer reads it (``GET …/results``), or null.
    result: dict[str, Any] | None = None


class EventOut(_Response):
    partition: int
    offset: int
    event: dict[str, Any]


class PartitionLagOut(_Response):
    partition: int
    end_offset: int
    applied: int
    lag: int


class PartitionOwnerOut(_Response):
    partition: int
    replica_id: str | None = Field(description="The replica that folds it; null: released")
    generation: int = Field(description="Bumped at every change of owner (0: never owned)")
    live: bool = Field(description="Whether the owner's heartbeat is current")


class ProjectorOut(_Response):
    run: str
    at: float
    log_records: int
    lag: int
    partitions: list[PartitionLagOut] = Field(
        description="The partitions this replica folds (all of them for a lone replica)"
    )
    replica_id: str = Field(description="This replica's name in the partition leases")
    owners: list[PartitionOwnerOut] = Field(description="Every partition's owner")
