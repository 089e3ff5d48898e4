"""What a fold produces: an episode's projection and its parts (immutable values).

The parts a fold builds by the thousand (boundaries, sessions, ledger rows) are ``NamedTuple``s:
one C-level tuple allocation each, where a frozen dataclass pays a Python ``__setattr__`` per field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import orjson

from rolloutlog.core._ids import capture_key
from rolloutlog.core._opaque import LinePieces, Opaque, encode_line_pieces, joined, mapped

#: A projection's status at its cut (the catalog's episodes say ``running``/``finished``/
#: ``excluded``: docs/design.md §11).
ProjectionStatus = Literal["live", "finished"]


class BoundaryView(NamedTuple):
    """The latest boundary of one owner (the environment, or an agent session)."""

    stage: str
    next: str | None
    state: Opaque | None
    step: int | None
    offset: int


class SessionView(NamedTuple):
    """An open resources or agent session at the cut, with its latest recorded state."""

    session_id: str
    kind: str
    participant: str
    mode: str
    verify: str
    state: Opaque | None


class LedgerEntry(NamedTuple):
    """One token-capture row, the one type of it past the append (``LedgerRowData`` is the
    ``ledger.row`` event's data, which ``of_data`` reads).

    A projection's rows hold their token ids as the raw JSON array they were logged as
    (``token_ids_json``); a policy's rows (``participants.LedgerRowInfo``, this type) hold none
    (``b""``) and name the worker that recorded them (``recorded_by``, None for a row restored
    from a projection), which says where a row came from, not what it is: rows compare equal
    without it.
    """

    call_id: str
    parent_call_id: str | None
    fingerprint: str
    context_digest: str
    policy_version: int
    prev_len: int
    cum_len: int
    digest: str
    staging_key: str | None
    constrained: bool
    recorded_by: str | None = None
    token_ids_json: bytes = b""

    @classmethod
    def of_data(cls, data: Mapping[str, Any], token_ids_json: bytes) -> LedgerEntry:
        """The row a ``ledger.row`` event's data records (its token ids as logged)."""
        return cls(
            call_id=data["call_id"],
            parent_call_id=data.get("parent_call_id"),
            fingerprint=data["fingerprint"],
            context_digest=data["context_digest"],
            policy_version=data["policy_version"],
            prev_len=data["prev_len"],
            cum_len=data["cum_len"],
            digest=data["digest"],
            staging_key=data.get("staging_key"),
            constrained=bool(data.get("constrained", False)),
            token_ids_json=token_ids_json,
        )

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> LedgerEntry:
        """A row as a policy keeps it from its JSON (a projection's, or ``to_json``'s): its
        token ids are left out."""
        return cls(
            call_id=row["call_id"],
            parent_call_id=row.get("parent_call_id"),
            fingerprint=row["fingerprint"],
            context_digest=row["context_digest"],
            policy_version=int(row["policy_version"]),
            prev_len=int(row["prev_len"]),
            cum_len=int(row["cum_len"]),
            digest=row["digest"],
            staging_key=row.get("staging_key"),
            constrained=bool(row.get("constrained", False)),
            recorded_by=row.get("recorded_by"),
        )

    def token_ids(self) -> list[int]:
        ids: list[int] = orjson.loads(self.token_ids_json)
        return ids

    def to_json(self) -> dict[str, Any]:
        """The REST form of a projection's row (its token ids spliced in raw); a row without
        token ids (a policy's) gives its fields and ``recorded_by`` instead."""
        if not self.token_ids_json:
            return {name: getattr(self, name) for name in _POLICY_ROW_FIELDS}
        return {
            "call_id": self.call_id,
            "parent_call_id": self.parent_call_id,
            "fingerprint": self.fingerprint,
            "context_digest": self.context_digest,
            "policy_version": self.policy_version,
            "prev_len": self.prev_len,
            "token_ids": orjson.Fragment(self.token_ids_json),
            "cum_len": self.cum_len,
            "digest": self.digest,
            "staging_key": self.staging_key,
            "constrained": self.constrained,
        }

    def _what_it_is(self) -> tuple[Any, ...]:
        return (*self[:10], self[11])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LedgerEntry):
            return self._what_it_is() == other._what_it_is()
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self._what_it_is())


#: What ``to_json`` gives of a row without token ids (a policy's).
_POLICY_ROW_FIELDS = tuple(name for name in LedgerEntry._fields if name != "token_ids_json")


@dataclass(frozen=True, slots=True)
class GenerationCut:
    """A durable token prefix of an in-flight policy call, which the replacement call continues.

    ``terminal`` means the call completed (nothing is left to generate).
    """

    call_id: str
    parent_call_id: str | None
    request_digest: str
    token_ids: tuple[int, ...]
    terminal: bool
    policy_version: int
    staging_key: str | None
    #: Why the chunks stop being usable, when they do (a gap, or a start other than 0).
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class EpisodeProjection:
    """The fold of one episode's events up to its cut (docs/design.md §4)."""

    episode: str
    attempt: int
    status: ProjectionStatus
    cut: int
    first_offset: int | None
    task: Opaque | None
    task_digest: str | None
    deadline_s: float | None
    boundaries: Mapping[str, BoundaryView]
    sessions: Mapping[str, SessionView]
    ledger: tuple[LedgerEntry, ...]
    generation_cut: GenerationCut | None
    #: Owners whose wait-mode step is open at the cut, with the offset of its ``step.started``.
    open_waits: Mapping[str, int]
    #: Offset of the event that ends the committed prefix (last boundary or ``episode.started``).
    committed_through: int | None
    reward: float | None = None
    result: Opaque | None = None
    events_folded: int = 0
    payload_bytes: int = 0
    staging_keys: tuple[str, ...] = field(default=())

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.attempt)

    @property
    def last_stage(self) -> str | None:
        """The stage of the environment's latest boundary (for analysts)."""
        env = self.boundaries.get("environment")
        return env.stage if env is not None else None

    def restart_only_sessions(self) -> list[str]:
        return [s.session_id for s in self.sessions.values() if s.mode == "restart_only"]

    def to_json(self) -> dict[str, Any]:
        """The REST form (docs/design.md §8): opaque states as ``Opaque`` (encoded raw by orjson)."""
        cut = self.generation_cut
        return {
            "episode": self.episode,
            "attempt": self.attempt,
            "capture_key": self.capture_key,
            "status": self.status,
            "task": self.task,
            "task_digest": self.task_digest,
            "boundaries": {
                owner: {"stage": b.stage, "next": b.next, "state": b.state, "step": b.step}
                for owner, b in self.boundaries.items()
            },
            "sessions": {
                sid: {
                    "kind": s.kind,
                    "participant": s.participant,
                    "mode": s.mode,
                    "verify": s.verify,
                    "state": s.state,
                }
                for sid, s in self.sessions.items()
            },
            "ledger": [row.to_json() for row in self.ledger],
            "generation_cut": None
            if cut is None
            else {
                "call_id": cut.call_id,
                "parent_call_id": cut.parent_call_id,
                "request_digest": cut.request_digest,
                "token_ids": list(cut.token_ids),
                "terminal": cut.terminal,
                "policy_version": cut.policy_version,
                "staging_key": cut.staging_key,
            },
        }


#: What a line held costs besides its bytes (its tuple, strings and index entry).
LINE_OVERHEAD = 400


class ProjectionLine(NamedTuple):
    """A projection as the restore routes serve it: its ``ProjectionOut`` NDJSON line, encoded
    once (opaque states spliced in raw), with what the routes' filters and metrics read of it.
    A restore's cache holds these rather than the projections: an S1 projection is 5.4 KB as a
    line against ~8 KB as objects, and serving it again re-encodes nothing."""

    episode: str
    #: ``ProjectionOut`` as JSON ending with a newline, in pieces (``encode_line_pieces``): one
    #: ``bytes``, but for a line holding large opaque states, each of which is a piece of its
    #: own (the stream writes them as they are). The first piece is ``bytes`` and holds the head
    #: (``as_attempt``).
    pieces: LinePieces
    #: ``(kind, participant)`` of each open session.
    sessions: tuple[tuple[str, str], ...]
    #: A ledger to restore or a generation cut to continue (what ``kind=policy`` serves).
    policy: bool
    #: A boundary owned by an agent session.
    agent_boundary: bool
    #: ``continued`` / ``terminal`` for a generation cut (``served_cut_dispositions``), or None.
    cut: str | None

    @classmethod
    def of(cls, projection: EpisodeProjection) -> ProjectionLine:
        generation_cut = projection.generation_cut
        return cls(
            projection.episode,
            encode_line_pieces(projection.to_json()),
            tuple((s.kind, s.participant) for s in projection.sessions.values()),
            bool(projection.ledger) or generation_cut is not None,
            any(owner != "environment" for owner in projection.boundaries),
            None
            if generation_cut is None
            else "terminal"
            if generation_cut.terminal
            else "continued",
        )

    def as_attempt(self, attempt: int, *, was: int) -> ProjectionLine:
        """This line (of attempt ``was``) as attempt ``attempt``'s: a restore continues a
        projection prepared at the cut, in which only the attempt and its capture key change
        (``to_json``'s first fields; the rest of the line is kept as it is)."""
        head = _line_head(self.episode, was)
        first, *rest = self.pieces
        if not (isinstance(first, bytes) and first.startswith(head)):
            raise ValueError(f"the line of {self.episode!r} is not attempt {was}'s")
        first = _line_head(self.episode, attempt) + first[len(head) :]
        return self._replace(pieces=(first, *rest))

    @property
    def line(self) -> bytes:
        """The whole line (joined, when it is in pieces)."""
        return joined(self.pieces)

    @property
    def size(self) -> int:
        """The line's length in bytes."""
        return sum(len(piece) for piece in self.pieces)

    @property
    def held_bytes(self) -> int:
        """What keeping this line costs the heap, as the caches count it against their budgets:
        its pieces but those mapped from a file (``mapped``), plus ``LINE_OVERHEAD``."""
        return LINE_OVERHEAD + sum(len(p) for p in self.pieces if not mapped(p))

    def matches(self, kind: str | None, participant: str | None) -> bool:
        """The bulk route's filter: does this projection hold something for that participant?

        - ``participant=P`` (with ``kind`` agent or resources, or none): a session opened by P
          (of that kind).
        - ``kind=environment``: every projection (the environment drives every episode).
        - ``kind=policy``: a ledger to restore or a generation cut to continue.
        - ``kind=agent``: an agent session or a boundary owned by an agent session.
        - ``kind=resources``: a resources session.
        """
        if participant is not None:
            return any(p == participant and kind in (None, k) for k, p in self.sessions)
        if kind is None or kind == "environment":
            return True
        if kind == "policy":
            return self.policy
        if kind == "agent" and self.agent_boundary:
            return True
        return any(k == kind for k, _ in self.sessions)


def _line_head(episode: str, attempt: int) -> bytes:
    """The start of a ``ProjectionLine`` up to its ``capture_key`` (``to_json``'s first three
    fields, as orjson writes them), with the comma that follows."""
    head = {"episode": episode, "attempt": attempt, "capture_key": capture_key(episode, attempt)}
    return orjson.dumps(head)[:-1] + b","
