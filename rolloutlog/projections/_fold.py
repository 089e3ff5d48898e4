"""The fold: an episode's events up to its cut → its projection (docs/design.md §4, §5). No I/O.

The fold reads records the way the log keeps them: decoded metadata plus the raw bytes of the
payload field, so opaque states pass through undecoded and ledger digests are checked on the raw
token arrays. ``project_events`` accepts typed events for callers that have them. Each record is
applied by the one state machine, ``EpisodeFold`` (``_episode``), which the projector also runs,
without payloads, for every live episode (``_tracker``); the projector applies rule 2 by pinning
the state at the checkpoint's marker and continuing it there when the restore commits
(``EpisodeFold.begin_attempt``), which is what selecting the records below the cut does here:
both are the one restore transition of ``rolloutlog.core._restore``.

Rules, in the order they apply to each record before the cut:

1. ``checkpoint.marker`` records belong to no episode and are skipped.
2. A committed ``attempt.started`` (its restore id is in ``committed_restores``, when given) makes
   its attempt current and drops every event already kept at or above its ``cut``: the new attempt
   continues the projection of the old one at that cut — its committed prefix and generation cut;
   the old tail's session changes and ledger rows stay dropped.
3. Zombies: an event of a participant epoch lower than one already seen for that participant id.
4. Duplicates: an event whose ``seq`` is not above the highest seen for its (participant id, epoch)
   — a participant's events for one episode reach the log in ``seq`` order, so a retry can only
   repeat a seq already seen.
5. Fenced attempts: an event of any attempt other than the current one.

The kept events then split at the last ``step.boundary`` (or ``episode.started``): the committed
prefix is folded whole; of the tail only the generation cut survives, and wait steps still open.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from rolloutlog.core import EpisodeFold, EpisodeProjection, select_records
from rolloutlog.log import (
    Event,
    encode_record,
    ledger_digest,
    peek_record,
    split_record,
    token_count,
)

#: One record as the fold reads it: (offset, metadata, raw payload or None).
RecordView = tuple[int, dict[str, Any], bytes | None]
#: One record with its payload's place: (offset, metadata, record or payload, payload start).
_Placed = tuple[int, dict[str, Any], bytes, int]

__all__ = [
    "EpisodeFold",
    "fold_episode",
    "RecordView",
    "ledger_digest",
    "project_episode",
    "project_events",
    "project_raw",
    "select_records",
    "token_count",
]


def project_episode(
    episode: str,
    records: Iterable[RecordView],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    continuing_attempt: int | None = None,
    attempt_at_cut: int = 0,
    as_attempt: int | None = None,
    attempt: int | None = None,
) -> EpisodeProjection:
    """The projection of ``episode`` at ``cut`` from its records in partition order.

    ``continuing_attempt`` labels it as the attempt that will continue it (a restore's new
    attempt); ``attempt_at_cut`` is the episode's attempt at the cut, for records that start
    after the restore that made it current (a restarted episode's replay). ``as_attempt`` and
    ``attempt`` are their former names.
    """
    fold = fold_episode(
        episode,
        records,
        cut,
        committed_restores,
        continuing_attempt=as_attempt if as_attempt is not None else continuing_attempt,
        attempt_at_cut=attempt if attempt is not None else attempt_at_cut,
    )
    return fold.projection(cut)


def fold_episode(
    episode: str,
    records: Iterable[RecordView],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    continuing_attempt: int | None = None,
    attempt_at_cut: int = 0,
    keep_payloads: bool = True,
) -> EpisodeFold:
    """The state of ``episode`` at ``cut`` from its records in partition order, in either mode
    (``project_episode`` is its projection; its arguments are ``project_episode``'s)."""
    placed = [
        (offset, meta, payload if payload is not None else b"", 0)
        for offset, meta, payload in records
    ]
    restarted = any(meta["type"] == "attempt.started" for _, meta, _, _ in placed)
    return _fold(
        episode,
        placed,
        cut,
        committed_restores,
        restarted,
        continuing_attempt,
        attempt_at_cut,
        keep_payloads,
    )


def project_raw(
    episode: str,
    records: list[tuple[int, bytes]],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    continuing_attempt: int | None = None,
    attempt_at_cut: int = 0,
) -> EpisodeProjection:
    """The projection of ``episode`` at ``cut`` from its raw records: each record's metadata is
    decoded once (``peek_record``) and its payload is never copied out of it, so a replay of
    many episodes keeps few objects alive and a large state is not copied again here.

    Whether a restore truncates anything is read off the decoded metadata, not searched for in
    the records' bytes: a search ran through every payload (measured: 0.3-0.5 ms per 350 KB
    state, the largest part of S2's build)."""
    peeked = []
    restarted = False
    for offset, record in records:
        meta, start = peek_record(record)
        restarted = restarted or meta["type"] == "attempt.started"
        peeked.append((offset, meta, record, start))
    fold = _fold(
        episode, peeked, cut, committed_restores, restarted, continuing_attempt, attempt_at_cut
    )
    return fold.projection(cut)


def _fold(
    episode: str,
    records: list[_Placed],
    cut: int,
    committed_restores: Container[int] | None,
    restarted: bool,
    continuing_attempt: int | None,
    attempt_at_cut: int,
    keep_payloads: bool = True,
) -> EpisodeFold:
    if restarted:
        # Restores truncate what earlier attempts contributed: select first, then fold.
        kept, current = select_records(records, cut, committed_restores, attempt_at_cut)
        fold = EpisodeFold(episode, current, keep_payloads=keep_payloads)
        if continuing_attempt is not None:
            fold.attempt = continuing_attempt
        apply = fold.apply
        for offset, meta, record, start in kept:
            apply(offset, meta, record, start)
        return fold
    # The common case (no restore truncates anything): filter and fold as the records come.
    fold = EpisodeFold(episode, attempt_at_cut, keep_payloads=keep_payloads)
    if continuing_attempt is not None:
        fold.attempt = continuing_attempt
    observe = fold.observe
    for offset, meta, record, start in records:
        if offset >= cut:
            break
        observe(offset, meta, record, start)
    return fold


def project_events(
    episode: str,
    events: Iterable[tuple[int, Event]],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    keep_payloads: bool = True,
) -> EpisodeProjection:
    """The projection of ``episode`` at ``cut`` from typed events (as tests and golden streams
    hold them)."""
    records = [(offset, *split_record(encode_record(event))) for offset, event in events]
    fold = fold_episode(episode, records, cut, committed_restores, keep_payloads=keep_payloads)
    return fold.projection(cut)
