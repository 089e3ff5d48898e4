"""A projection by position (docs/design.md §10 "A restore"): what a fold's state says its
projection is made of — the metadata it folded and the offsets of the records whose payloads
the projection carries — so that a restore reads those records and composes the projection
from their bytes instead of folding the episode's records again.

The projector's trackers keep no payloads, but they keep where each one is: the task's
``episode.started``, each owner's latest boundary, each open session's latest state, the
committed ledger rows and the generation cut's chunks. A tracker's state at a checkpoint's cut is
exactly the fold's there (``EpisodeFold.exact``, which a restore's pins require), so its
``Composition`` with the payloads read back gives the fold's projection, line for line
(``tests/projections/test_compose.py`` compares every line with the fold's).

Composing needs the record layout (where a payload starts, a ledger row's metadata), which only
the log knows: the caller hands ``project`` two readers. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from rolloutlog.core._model import (
    BoundaryView,
    EpisodeProjection,
    LedgerEntry,
    SessionView,
)
from rolloutlog.core._opaque import Opaque
from rolloutlog.core._tail import CutChunks, generation_cut

if TYPE_CHECKING:
    from rolloutlog.core._episode import EpisodeFold

__all__ = ["Composition", "composition_of"]

_new = tuple.__new__


class Composition(NamedTuple):
    """One episode's projection by position: the fold's metadata at the cut, with the offsets of
    the records its payloads are read from (``positions``)."""

    episode: str
    attempt: int
    first_offset: int | None
    committed_through: int | None
    task_offset: int | None
    task_digest: str | None
    deadline_s: float | None
    #: Each owner's latest boundary (its state read from the record at the view's offset).
    boundaries: Mapping[str, BoundaryView]
    sessions: Mapping[str, SessionView]
    #: The record each session's state is read from (a session without one has no state).
    session_offsets: Mapping[str, int]
    ledger_offsets: Sequence[int]
    #: The tail's generation cut, its chunks' records named by their offsets.
    cut: CutChunks | None
    open_waits: Mapping[str, int]
    events: int
    payload_bytes: int
    staging_keys: tuple[str, ...]

    def positions(self) -> list[int]:
        """The offsets of every record this projection reads a payload or a row from."""
        out = [] if self.task_offset is None else [self.task_offset]
        out.extend(view[4] for view in self.boundaries.values())
        out.extend(self.session_offsets.values())
        out.extend(self.ledger_offsets)
        if self.cut is not None:
            out.extend(chunk[6] for chunk in self.cut[1])  # type: ignore[misc]
        return out

    def project(
        self,
        records: Mapping[int, bytes],
        cut: int,
        payload_start: Callable[[bytes], int],
        peek: Callable[[bytes], tuple[dict[str, Any], int]],
    ) -> EpisodeProjection:
        """The projection at ``cut``, its payloads read from ``records`` (by offset, every one
        of ``positions``): ``payload_start`` says where a record's payload starts (its length
        when it has none), ``peek`` decodes a ledger row's metadata too."""

        def payload(offset: int) -> bytes | None:
            record = records[offset]
            start = payload_start(record)
            return record[start:] if start < len(record) else None

        task = None
        if self.task_offset is not None:
            raw = payload(self.task_offset)
            task = Opaque(raw) if raw is not None else None
        boundaries: dict[str, BoundaryView] = {}
        for owner, boundary in self.boundaries.items():
            raw = payload(boundary[4])
            state = Opaque(raw) if raw is not None else None
            boundaries[owner] = _new(BoundaryView, (*boundary[:2], state, *boundary[3:]))
        sessions = dict(self.sessions)
        if self.session_offsets:
            for sid, offset in self.session_offsets.items():
                raw = payload(offset)
                view = sessions[sid]
                state = Opaque(raw) if raw is not None else None
                sessions[sid] = _new(SessionView, (*view[:5], state))
        ledger = []
        for offset in self.ledger_offsets:
            record = records[offset]
            meta, start = peek(record)
            tokens = record[start:] if start < len(record) else b"[]"
            ledger.append(LedgerEntry.of_data(meta["data"], tokens))
        generation = None
        if self.cut is not None:
            call, walked, terminal, last, problem = self.cut
            read = [(*chunk[:4], payload(chunk[6]), *chunk[5:]) for chunk in walked]  # type: ignore[arg-type]
            generation = generation_cut((call, read, terminal, last, problem))
        return EpisodeProjection(
            episode=self.episode,
            attempt=self.attempt,
            status="live",
            cut=cut,
            first_offset=self.first_offset,
            task=task,
            task_digest=self.task_digest,
            deadline_s=self.deadline_s,
            boundaries=boundaries,
            sessions=sessions,
            ledger=tuple(ledger),  # (the boundaries, sessions and waits are copies too)
            generation_cut=generation,
            open_waits=dict(self.open_waits),
            committed_through=self.committed_through,
            events_folded=self.events,
            payload_bytes=self.payload_bytes,
            staging_keys=self.staging_keys,
        )


def composition_of(fold: EpisodeFold) -> Composition | None:
    """``fold``'s projection by position, or None when it cannot be composed from records: a
    state that is not exactly the fold's (``exact``), a finished episode, delta boundaries
    (composed onto their base by a replay), or a position not kept (a state continued from a
    projection). It shares the fold's containers: use it before the fold changes again."""
    if not fold.exact or fold.finished or fold.boundary_deltas or fold.first_offset is None:
        return None
    if fold.task_digest is not None and fold.task_offset is None:
        return None
    found = fold._cut_chunks()
    if found is not None and any(chunk[6] is None for chunk in found[1]):
        return None
    return Composition(
        fold.episode,
        fold.attempt,
        fold.first_offset,
        fold.committed_through,
        fold.task_offset,
        fold.task_digest,
        fold.deadline_s,
        fold.boundaries,
        fold.sessions,
        fold.session_offsets or _NONE,
        fold.ledger_offsets or (),
        found,
        fold.open_waits,
        fold.events,
        fold.payload_bytes(),
        fold.referenced_staging_keys(),
    )


_NONE: dict[str, int] = {}
