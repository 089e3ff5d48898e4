"""The restore transition (docs/design.md §4 rule 2, §5): what a committed restore's
``attempt.started`` does to an episode, written once.

Its attempt becomes current and continues the old attempt's projection at the restore's cut —
the committed prefix and the generation cut go on; the tail's session changes and ledger rows
are dropped — or, for a restart, nothing carries on. Later records of older attempts are fenced.

The rule has two forms, for the two ways an episode is held, and one test of the record
(``restore_transition``):

- over records, ``select_records``: the records the projection at a cut folds. The full fold and
  the replay (``projections._fold``), the projector's catch-up, and the history route's "resumed
  from" (``resumed_boundary``) run it.
- over a fold's state, ``begin_attempt``: the projector's trackers, reset when the restore
  commits, from the state its plan pinned at the cut, from the projection it served, or from
  nothing (a restart); or only fenced, when the reset is not known (``"unknown"``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, Self

import orjson

from rolloutlog.core._episode_sessions import SessionRules
from rolloutlog.core._filters import EventFilters
from rolloutlog.core._model import BoundaryView, EpisodeProjection, LedgerEntry, SessionView
from rolloutlog.core._opaque import Opaque
from rolloutlog.core._tail import Chunk
from rolloutlog.core._verify import Lineage

__all__ = [
    "RestoreTransition",
    "restore_transition",
    "AttemptRules",
    "resumed_boundary",
    "select_records",
]

#: What a record is read as here: its offset and metadata first.
_Selectable = tuple[Any, ...]


class RestoreTransition(NamedTuple):
    """A committed restore's ``attempt.started``, as the transition reads it."""

    #: The attempt it begins.
    attempt: int
    #: The attempt current before it (the one a continued episode resumes from).
    previous_attempt: int
    restore_id: int
    #: The episode's cut in its partition: the older attempts' records below it are what the new
    #: attempt continues; those at or above it are dropped.
    cut: int


def restore_transition(
    meta: dict[str, Any], committed_restores: Container[int] | None = None
) -> RestoreTransition | None:
    """The transition a record begins: the ``attempt.started`` of a restore in
    ``committed_restores`` (of any restore when None), or None."""
    if meta["type"] != "attempt.started":
        return None
    data = meta["data"]
    if committed_restores is not None and data["restore_id"] not in committed_restores:
        return None
    return RestoreTransition(
        meta["attempt"], data["previous_attempt"], data["restore_id"], data["cut"]
    )


# -- over records --------------------------------------------------------------------------------


def select_records(
    records: Sequence[_Selectable],
    cut: float,
    committed_restores: Container[int] | None = None,
    attempt_at_cut: int = 0,
    *,
    attempt: int | None = None,
) -> tuple[list[Any], int]:
    """The records of one episode that the projection at ``cut`` folds, and the current attempt.

    The records may start after the episode's first event (a replay starts where the
    checkpoint's live episodes need it to): the attempt current at their start is the
    ``previous_attempt`` of the first committed ``attempt.started`` among them, or
    ``attempt_at_cut`` (the episode's attempt at the cut; ``attempt``, its former name) when there
    is none. Each record is read as ``(offset, metadata, …)``: ``project_raw`` selects
    ``(offset, metadata, record, start)``.
    """
    if attempt is not None:
        attempt_at_cut = attempt
    kept: list[Any] = []
    filters = EventFilters(_attempt_at_start(records, committed_restores, attempt_at_cut))
    for record in records:
        offset, meta = record[0], record[1]
        if offset >= cut:
            break
        kind = meta["type"]
        if kind == "checkpoint.marker":
            continue
        if kind == "attempt.started":
            transition = restore_transition(meta, committed_restores)
            if transition is None or transition.attempt <= filters.current_attempt:
                continue
            filters.current_attempt = transition.attempt
            kept = [r for r in kept if r[0] < transition.cut]
            if kept:
                # Folded, it drops the old attempt's uncommitted tail (``EpisodeFold.apply``).
                kept.append(record)
            continue
        if filters.admits(meta):
            kept.append(record)
    return kept, filters.current_attempt


def _attempt_at_start(
    records: Sequence[_Selectable], committed_restores: Container[int] | None, attempt: int
) -> int:
    for record in records:
        meta = record[1]
        if meta["type"] == "attempt.started":
            transition = restore_transition(meta, committed_restores)
            if transition is not None:
                return transition.previous_attempt
    return attempt


def resumed_boundary(
    records: Sequence[_Selectable],
    started_at: int,
    committed_restores: Container[int] | None = None,
) -> Any | None:
    """The ``step.boundary`` record that the attempt begun by the ``attempt.started`` at offset
    ``started_at`` resumed from: the last one the transition keeps there (the end of the
    committed prefix it continues), or None."""
    kept, _ = select_records(records, started_at + 1, committed_restores)
    for record in reversed(kept):
        if record[1]["type"] == "step.boundary":
            return record
    return None


# -- over a fold's state -------------------------------------------------------------------------


class AttemptRules(SessionRules):
    """The transition over a fold's state, kept beside the record form (``EpisodeFold`` inherits
    it, with the session rules below it; it reads and writes the fold's fields, declared here
    as the fold sets them)."""

    # Set by ``EpisodeFold._clear``; here as they are replaced here.
    __slots__ = (
        "_cut_staging_known",
        "_latest_call",
        "_staging",
        "_verdict",
        "attempt",
        "committed_through",
        "deadline_s",
        "exact",
        "filters",
        "finished",
        "finished_offset",
        "first_offset",
        "first_ts",
        "last_stage",
        "ledger",
        "open_waits",
        "size_bytes",
        "task",
        "task_bytes",
        "task_digest",
        "version",
    )
    STATE_FIELDS: ClassVar[tuple[str, ...]]
    version: int
    attempt: int
    filters: EventFilters
    exact: bool
    keep_payloads: bool
    first_offset: int | None
    first_ts: float | None
    committed_through: int | None
    task: Opaque | None
    task_digest: str | None
    task_bytes: int
    deadline_s: float | None
    boundaries: dict[str, BoundaryView]
    boundary_bytes: dict[str, int]
    last_stage: str | None
    sessions: dict[str, SessionView]
    session_bytes: dict[str, int]
    restart_only_open: bool
    open_waits: dict[str, int]
    staging_keys: list[str]
    ledger: list[LedgerEntry] | None
    lineage: Lineage | None
    finished: bool
    finished_offset: int | None
    size_bytes: int
    _tail_chunks: list[Chunk]
    _latest_call: str | None
    _cut_staging_known: bool
    _staging: tuple[str, ...] | None
    _verdict: tuple[str | None] | None
    # The fold's own steps this transition runs.
    _clear: Callable[[int], None]
    _drop_tail: Callable[[], None]
    payload_bytes: Callable[[], int]

    def begin_attempt(
        self,
        attempt: int,
        at_cut: Self | EpisodeProjection | Literal["restart", "unknown"],
    ) -> None:
        """The transition on a fold's state: ``attempt`` becomes current, continuing ``at_cut``.

        - the state at the cut: the old attempt's committed prefix and its tail's generation cut
          go on; the tail's session changes and undelivered calls are dropped (what
          ``select_records`` and ``EpisodeFold.apply`` do at the ``attempt.started``);
        - a projection: it holds the committed prefix and the generation cut, not the tail it
          came from, nor the chunks behind its cut (which a restore policy may have dropped), so
          the state is no longer exactly the fold's (``exact``) and its verdicts come from
          replays;
        - ``"restart"``: nothing carries on;
        - ``"unknown"`` (met while catching up, without the restore's reset): later records of
          older attempts are fenced, but the cut's truncation needs the history, so the state is
          no longer exactly the fold's; an attempt not past the current one changes nothing.
        """
        if isinstance(at_cut, str):
            if at_cut == "restart":
                self.version += 1
                self._clear(attempt)
            elif attempt > self.filters.current_attempt:  # "unknown"
                self.version += 1  # its manifest entry names the new attempt
                self.filters.current_attempt = attempt
                self.attempt = attempt
                self.exact = False
        elif isinstance(at_cut, EpisodeProjection):
            self._continue_projection(at_cut, attempt)
        else:
            self._continue_state(at_cut, attempt)

    def _continue_state(self, state: Self, attempt: int) -> None:
        version = self.version
        if state is not self:
            filters = self.filters
            for name in self.STATE_FIELDS:
                setattr(self, name, getattr(state, name))
            self.filters = filters
        self._drop_tail()
        self.filters.current_attempt = attempt
        self.attempt = attempt
        self.version = version + 1
        self._verdict = None
        self._staging = None
        self.first_ts = None
        self.finished = False
        self.finished_offset = None
        self.size_bytes = self.payload_bytes()

    def _continue_projection(self, projection: EpisodeProjection, attempt: int) -> None:
        self.version += 1
        self._clear(attempt)
        self.exact = False
        keep = self.keep_payloads
        self.first_offset = projection.first_offset
        self.committed_through = projection.committed_through
        self.task_digest = projection.task_digest
        self.deadline_s = projection.deadline_s
        if projection.task is not None:
            self.task = projection.task if keep else None
            self.task_bytes = len(projection.task.raw)
        for owner, boundary in projection.boundaries.items():
            state = boundary.state
            self.boundaries[owner] = boundary if keep else boundary._replace(state=None)
            self.boundary_bytes[owner] = len(state.raw) if state is not None else 0
        self.last_stage = projection.last_stage
        for sid, session in projection.sessions.items():
            state = session.state
            self.sessions[sid] = session if keep else session._replace(state=None)
            self.session_bytes[sid] = len(state.raw) if state is not None else 0
        self.restart_only_open = bool(projection.restart_only_sessions())
        self.open_waits = dict(projection.open_waits)
        for row in projection.ledger:
            if row.staging_key and row.staging_key not in self.staging_keys:
                self.staging_keys.append(row.staging_key)
        if keep:
            self.ledger = list(projection.ledger)
        elif self.lineage is not None:  # judged already: the restore continued it
            self.lineage.task_seen = projection.task is not None
            self.lineage.rows = {
                row.call_id: (row.digest, row.cum_len) for row in projection.ledger
            }
        cut = projection.generation_cut
        if cut is not None:
            facts = (cut.parent_call_id, cut.request_digest, cut.policy_version, cut.staging_key)
            tokens = orjson.dumps(list(cut.token_ids)) if keep else None
            chunk = (0, len(cut.token_ids), cut.terminal, facts, tokens, cut.call_id, None)
            self._tail_chunks.append(chunk)
            self._latest_call = cut.call_id
            self._cut_staging_known = False
        self.size_bytes = self.payload_bytes()
