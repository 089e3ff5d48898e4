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

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import orjson

from rolloutlog.core._filters import EventFilters
from rolloutlog.core._model import EpisodeProjection

if TYPE_CHECKING:
    from rolloutlog.core._episode import EpisodeFold

__all__ = [
    "RestoreTransition",
    "restore_transition",
    "begin_attempt",
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


def begin_attempt(
    fold: EpisodeFold,
    attempt: int,
    at_cut: EpisodeFold | EpisodeProjection | Literal["restart", "unknown"],
) -> None:
    """The transition on a fold's state: ``attempt`` becomes current, continuing ``at_cut``.

    - the state at the cut: the old attempt's committed prefix and its tail's generation cut go
      on; the tail's session changes and undelivered calls are dropped (what ``select_records``
      and ``EpisodeFold.apply`` do at the ``attempt.started``);
    - a projection: it holds the committed prefix and the generation cut, not the tail it came
      from, nor the chunks behind its cut (which a restore policy may have dropped), so the state
      is no longer exactly the fold's (``exact``) and its verdicts come from replays;
    - ``"restart"``: nothing carries on;
    - ``"unknown"`` (met while catching up, without the restore's reset): later records of older
      attempts are fenced, but the cut's truncation needs the history, so the state is no longer
      exactly the fold's; an attempt not past the current one changes nothing.
    """
    if isinstance(at_cut, str):
        if at_cut == "restart":
            fold.version += 1
            fold._clear(attempt)
        elif attempt > fold.filters.current_attempt:  # "unknown"
            fold.version += 1  # its manifest entry names the new attempt
            fold.filters.current_attempt = attempt
            fold.attempt = attempt
            fold.exact = False
    elif isinstance(at_cut, EpisodeProjection):
        _continue_projection(fold, at_cut, attempt)
    else:
        _continue_state(fold, at_cut, attempt)


def _continue_state(fold: EpisodeFold, state: EpisodeFold, attempt: int) -> None:
    version = fold.version
    if state is not fold:
        filters = fold.filters
        for name in fold.STATE_FIELDS:
            setattr(fold, name, getattr(state, name))
        fold.filters = filters
    fold._drop_tail()
    fold.filters.current_attempt = attempt
    fold.attempt = attempt
    fold.version = version + 1
    fold._verdict = None
    fold._staging = None
    fold.first_ts = None
    fold.finished = False
    fold.finished_offset = None
    fold.size_bytes = fold.payload_bytes()


def _continue_projection(fold: EpisodeFold, projection: EpisodeProjection, attempt: int) -> None:
    fold.version += 1
    fold._clear(attempt)
    fold.exact = False
    keep = fold.keep_payloads
    fold.first_offset = projection.first_offset
    fold.committed_through = projection.committed_through
    fold.task_digest = projection.task_digest
    fold.deadline_s = projection.deadline_s
    if projection.task is not None:
        fold.task = projection.task if keep else None
        fold.task_bytes = len(projection.task.raw)
    for owner, boundary in projection.boundaries.items():
        state = boundary.state
        fold.boundaries[owner] = boundary if keep else boundary._replace(state=None)
        fold.boundary_bytes[owner] = len(state.raw) if state is not None else 0
    fold.last_stage = projection.last_stage
    for sid, session in projection.sessions.items():
        state = session.state
        fold.sessions[sid] = session if keep else session._replace(state=None)
        fold.session_bytes[sid] = len(state.raw) if state is not None else 0
    fold.restart_only_open = bool(projection.restart_only_sessions())
    fold.open_waits = dict(projection.open_waits)
    for row in projection.ledger:
        if row.staging_key and row.staging_key not in fold.staging_keys:
            fold.staging_keys.append(row.staging_key)
    if keep:
        fold.ledger = list(projection.ledger)
    elif fold.lineage is not None:  # judged already: the restore continued it
        fold.lineage.task_seen = projection.task is not None
        fold.lineage.rows = {row.call_id: (row.digest, row.cum_len) for row in projection.ledger}
    cut = projection.generation_cut
    if cut is not None:
        facts = (cut.parent_call_id, cut.request_digest, cut.policy_version, cut.staging_key)
        tokens = orjson.dumps(list(cut.token_ids)) if keep else None
        chunk = (0, len(cut.token_ids), cut.terminal, facts, tokens, cut.call_id)
        fold._tail_chunks.append(chunk)
        fold._latest_call = cut.call_id
        fold._cut_staging_known = False
    fold.size_bytes = fold.payload_bytes()
