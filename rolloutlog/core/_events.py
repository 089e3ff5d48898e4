"""The event envelope and every event type of docs/design.md §3, as immutable pydantic models."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, Self, TypeAlias, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from rolloutlog.core._ids import NAME_PATTERN, episode_id_problem
from rolloutlog.core._opaque import Opaque

ENVELOPE_VERSION: Literal[1] = 1

ParticipantKind: TypeAlias = Literal["environment", "policy", "agent", "resources"]
#: Who may write an event: the four participant kinds, and the service itself (markers, attempts).
WriterKind: TypeAlias = Literal["environment", "policy", "agent", "resources", "service"]
StepMode: TypeAlias = Literal["replay", "wait"]
#: ``checkpoint``: the session's state is exported when a checkpoint asks (export-on-checkpoint).
SessionMode: TypeAlias = Literal["restart_only", "stateless", "exported", "checkpoint"]
#: The participant id the service writes its own events (markers, attempt starts) under.
SERVICE_PARTICIPANT_ID = "rolloutlog"


def _check_episode(value: str) -> str:
    problem = episode_id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


EpisodeId = Annotated[str, AfterValidator(_check_episode)]
#: ParticipantIdentity, session, owner, stage and call ids (checked by pydantic-core's regex, no Python call).
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
NonNegative = Annotated[int, Field(ge=0)]
#: ``seq`` stays below 2^53: a larger one could not round-trip through JSON readers that use
#: doubles, and no honest participant gets near it; one near 2^63 would make the fold drop every
#: later event of its participant epoch in the episode as a duplicate.
MAX_SEQ = 2**53
Seq = Annotated[int, Field(ge=0, lt=MAX_SEQ)]
Digest = Annotated[str, Field(min_length=1, max_length=128)]
#: Token ids: plain ints (a per-item bound would cost 4x the validation time of a 512-token row).
TokenIds = list[int]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ParticipantIdentity(_Frozen):
    """Who wrote an event: ``kind``, ``id`` and the ``epoch`` granted at registration."""

    id: Name
    kind: WriterKind
    epoch: NonNegative


# -- data of each event type -------------------------------------------------------------------

#: A rule across a data model's fields: given the data (every field, payload included, as a
#: mapping), the reason it breaks the rule, or None.
DataRule: TypeAlias = Callable[[Mapping[str, Any]], "str | None"]


class _Data(_Frozen):
    """An event type's data. ``rule``, when a type has one, is the one definition of what its
    data must satisfy across fields: this model's validator calls it, and so do the append's
    fast path and the SDK's check (``_shapes.DATA_RULES``), on the data as a dict."""

    rule: ClassVar[DataRule | None] = None

    @model_validator(mode="after")
    def _follows_rule(self) -> Self:
        rule = type(self).rule
        if rule is not None:
            problem = rule(self.__dict__)
            if problem is not None:
                raise ValueError(problem)
        return self


def _lengths_chain(data: Mapping[str, Any]) -> str | None:
    if data["cum_len"] != data["prev_len"] + len(data["token_ids"]):
        return "cum_len must equal prev_len + len(token_ids)"
    return None


class EpisodeStartedData(_Data):
    task: Opaque
    task_digest: Digest
    deadline_s: float | None = None


class StepStartedData(_Data):
    owner: Name
    stage: Name
    mode: StepMode = "wait"


class StepBoundaryData(_Data):
    owner: Name
    stage: Name
    next: Name | None = None
    state: Opaque


class LedgerRowData(_Data):
    call_id: Name
    parent_call_id: Name | None
    fingerprint: Digest
    context_digest: Digest
    policy_version: NonNegative
    prev_len: NonNegative
    token_ids: TokenIds
    cum_len: NonNegative
    digest: Digest
    staging_key: str | None = None
    constrained: bool = False

    rule = _lengths_chain


class GenerationChunkData(_Data):
    call_id: Name
    parent_call_id: Name | None
    request_digest: Digest
    start: NonNegative
    token_ids: TokenIds
    policy_version: NonNegative
    staging_key: str | None = None
    #: The call completed with this chunk (a terminal cut if it was never delivered).
    done: bool = False


class SessionStartedData(_Data):
    session_id: Name
    mode: SessionMode = "restart_only"
    verify: StepMode = "wait"


class SessionStateData(_Data):
    session_id: Name
    state: Opaque
    #: Set on an export-on-checkpoint session's export for that checkpoint (None otherwise).
    checkpoint_id: NonNegative | None = None


class SessionEndedData(_Data):
    session_id: Name


class EpisodeFinishedData(_Data):
    reward: float | None = None
    result: Opaque | None = None


class CheckpointMarkerData(_Data):
    checkpoint_id: NonNegative
    controller_epoch: NonNegative


class AttemptStartedData(_Data):
    restore_id: NonNegative
    checkpoint_id: NonNegative
    previous_attempt: NonNegative
    #: The episode's cut in its partition: the previous attempts' events below it form the
    #: projection the new attempt continues; those at or above it are dropped.
    cut: NonNegative


# -- envelopes ---------------------------------------------------------------------------------


class Envelope(_Frozen):
    v: Literal[1] = ENVELOPE_VERSION
    episode: EpisodeId
    attempt: NonNegative = 0
    step: NonNegative | None = None
    participant: ParticipantIdentity
    seq: Seq
    ts: float


class EpisodeStarted(Envelope):
    type: Literal["episode.started"] = "episode.started"
    data: EpisodeStartedData


class StepStarted(Envelope):
    type: Literal["step.started"] = "step.started"
    data: StepStartedData


class StepBoundary(Envelope):
    type: Literal["step.boundary"] = "step.boundary"
    data: StepBoundaryData


class LedgerRow(Envelope):
    type: Literal["ledger.row"] = "ledger.row"
    data: LedgerRowData


class GenerationChunk(Envelope):
    type: Literal["generation.chunk"] = "generation.chunk"
    data: GenerationChunkData


class SessionStarted(Envelope):
    type: Literal["session.started"] = "session.started"
    data: SessionStartedData


class SessionState(Envelope):
    type: Literal["session.state"] = "session.state"
    data: SessionStateData


class SessionEnded(Envelope):
    type: Literal["session.ended"] = "session.ended"
    data: SessionEndedData


class EpisodeFinished(Envelope):
    type: Literal["episode.finished"] = "episode.finished"
    data: EpisodeFinishedData


class CheckpointMarker(Envelope):
    """Written by the service into every partition; it belongs to no episode."""

    type: Literal["checkpoint.marker"] = "checkpoint.marker"
    episode: None = None  # type: ignore[assignment]
    data: CheckpointMarkerData


class AttemptStarted(Envelope):
    type: Literal["attempt.started"] = "attempt.started"
    data: AttemptStartedData


Event = Annotated[
    EpisodeStarted
    | StepStarted
    | StepBoundary
    | LedgerRow
    | GenerationChunk
    | SessionStarted
    | SessionState
    | SessionEnded
    | EpisodeFinished
    | CheckpointMarker
    | AttemptStarted,
    Field(discriminator="type"),
]

#: Each event type's class, by its ``type`` (read off ``Event``, the one list of them).
EVENT_CLASSES: dict[str, type[Envelope]] = {
    cls.model_fields["type"].default: cls for cls in get_args(get_args(Event)[0])
}

#: Event types only the service may write.
SERVICE_EVENT_TYPES = frozenset({"checkpoint.marker", "attempt.started"})
