"""A projection by position (docs/design.md §10 "A restore"): a fold's state without payloads
knows where each of its projection's payloads is — the task's ``episode.started``, each owner's
latest boundary, each open session's latest state, the committed ledger rows, the generation
cut's chunks — so that a restore reads those records and composes the projection from their
bytes instead of folding the episode's records again.

The projector's trackers keep those positions. A tracker's state at a checkpoint's cut is exactly
the fold's there (``EpisodeFold.exact``, which a restore's pins require), so the projection
composed from it is the fold's projection, line for line (``tests/projections/test_compose.py``
compares every line with the fold's).

Composing needs the record layout (where a payload starts, a ledger row's metadata), which only
the log knows: the caller hands ``compose_projection`` two readers. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rolloutlog.core._model import (
    BoundaryView,
    EpisodeProjection,
    LedgerEntry,
    SessionView,
)
from rolloutlog.core._opaque import SPLICE_BYTES, Opaque
from rolloutlog.core._tail import generation_cut

if TYPE_CHECKING:
    from rolloutlog.core._episode import EpisodeFold

__all__ = ["composable", "compose_projection", "projection_positions"]

_new = tuple.__new__


def composable(fold: EpisodeFold) -> bool:
    """Whether ``fold``'s projection can be composed from the records at its positions: not for
    a state that is not exactly the fold's (``exact``), a finished episode, one with delta
    boundaries (composed onto their base by a replay), or a position not kept (a state continued
    from a projection, which has none)."""
    if not fold.exact or fold.finished or fold.boundary_deltas or fold.first_offset is None:
        return False
    if fold.task_digest is not None and fold.task_offset is None:
        return False
    found = fold._cut_chunks()
    return found is None or all(chunk[6] is not None for chunk in found[1])


def projection_positions(fold: EpisodeFold) -> list[int]:
    """The offsets of every record ``fold``'s projection reads a payload or a row from (of a
    ``composable`` state)."""
    out = [] if fold.task_offset is None else [fold.task_offset]
    out.extend(view[4] for view in fold.boundaries.values())
    if fold.session_offsets:
        out.extend(fold.session_offsets.values())
    if fold.ledger_offsets:
        out.extend(fold.ledger_offsets)
    found = None if fold.finished else fold._cut_chunks()
    if found is not None:
        out.extend(chunk[6] for chunk in found[1])  # type: ignore[misc]
    return out


def _payload(record: bytes | memoryview, start: int) -> Opaque | None:
    """A state's payload in ``record`` from ``start`` (None when it has none): a view of the
    record when it is ``SPLICE_BYTES`` or more, which the projection's line then carries as it
    is (``encode_line_pieces``); a copy of a small one, which keeps no record alive."""
    if start >= len(record):
        return None
    if len(record) - start >= SPLICE_BYTES:
        return Opaque(memoryview(record)[start:])
    return Opaque(bytes(record[start:]))  # (a record read in place is a view: copied too)


def compose_projection(
    fold: EpisodeFold,
    records: Mapping[int, bytes | memoryview],
    cut: int,
    payload_start: Callable[[bytes | memoryview], int],
    peek: Callable[[bytes | memoryview], tuple[dict[str, Any], int]],
) -> EpisodeProjection:
    """``fold.projection(cut)`` with the payloads read from ``records`` (by offset: every one of
    ``projection_positions``): ``payload_start`` says where a record's payload starts (its length
    when it has none), ``peek`` decodes a ledger row's metadata too."""
    task = None
    if fold.task_offset is not None:
        record = records[fold.task_offset]
        start = payload_start(record)
        task = Opaque(record[start:]) if start < len(record) else None
    boundaries: dict[str, BoundaryView] = {}
    for owner, view in fold.boundaries.items():
        record = records[view[4]]
        start = payload_start(record)
        state = _payload(record, start)
        boundaries[owner] = _new(BoundaryView, (view[0], view[1], state, view[3], view[4]))
    sessions = dict(fold.sessions)
    for sid, offset in (fold.session_offsets or {}).items():
        record = records[offset]
        start = payload_start(record)
        state = _payload(record, start)
        sessions[sid] = _new(SessionView, (*sessions[sid][:5], state))
    ledger = []
    for offset in fold.ledger_offsets or ():
        record = records[offset]
        meta, start = peek(record)
        tokens = bytes(record[start:]) if start < len(record) else b"[]"
        ledger.append(LedgerEntry.of_data(meta["data"], tokens))
    generation = None
    found = fold._cut_chunks()
    if found is not None:
        call, walked, terminal, last, problem = found
        read = []
        for chunk in walked:
            record = records[chunk[6]]  # type: ignore[index]
            start = payload_start(record)
            kept = bytes(record[start:]) if start < len(record) else None
            read.append((*chunk[:4], kept, *chunk[5:]))
        generation = generation_cut((call, read, terminal, last, problem))
    return EpisodeProjection(
        episode=fold.episode,
        attempt=fold.attempt,
        status="live",
        cut=cut,
        first_offset=fold.first_offset,
        task=task,
        task_digest=fold.task_digest,
        deadline_s=fold.deadline_s,
        boundaries=boundaries,
        sessions=sessions,
        ledger=tuple(ledger),
        generation_cut=generation,
        open_waits=dict(fold.open_waits),
        committed_through=fold.committed_through,
        events_folded=fold.events,
        payload_bytes=fold.payload_bytes(),
        staging_keys=fold.referenced_staging_keys(),
    )
