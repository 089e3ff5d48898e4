"""Run one episode's events through the fold's two modes and check that they agree.

- the full fold (``project_events``: keeps payloads, selects records across restores);
- the projector's way (``follow``): an ``EpisodeTracker`` fed record by record, pinned at each
  committed restore's cut as the projector pins it at the checkpoint's marker and continued from
  there at the restore's ``attempt.started`` (``continue_at_cut``), in either mode.

They must agree on the manifest entry the projector would capture (action, cut, staging keys,
stage), on the restore's verdict, and on the projection's metadata.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from rolloutlog.core._verify import verify_projection
from rolloutlog.log import Event, encode_record, peek_record
from rolloutlog.projections import EpisodeFold, EpisodeProjection, project_events
from rolloutlog.projections._capture import CheckpointCapture
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._tracker import EpisodeTracker


class FullState(EpisodeFold):
    """The full fold's state, filed under a partition like a tracker (for the capture)."""

    __slots__ = ("partition",)

    def __init__(self, episode: str) -> None:
        super().__init__(episode, keep_payloads=True)
        self.partition = 0


def follow(
    episode: str,
    events: Sequence[tuple[int, Event]],
    cut: int,
    committed: Container[int] | None,
    *,
    keep_payloads: bool,
) -> EpisodeFold:
    """The state the projector holds after the records below ``cut``."""
    state: EpisodeFold = FullState(episode) if keep_payloads else EpisodeTracker(episode, 0)
    # Committed restores in stream order: [restore cut, offset of its record, pinned yet].
    restores: list[list[Any]] = [
        [event.data.cut, offset, False]  # type: ignore[union-attr]
        for offset, event in events
        if event.type == "attempt.started"
        and (committed is None or event.data.restore_id in committed)  # type: ignore[union-attr]
        and offset < cut
    ]
    for offset, event in events:
        if offset >= cut:
            break
        if restores and not restores[0][2] and restores[0][0] <= offset:
            state.pin()  # the checkpoint's marker: the state at the restore's cut
            restores[0][2] = True
        if event.type == "checkpoint.marker":
            continue
        if event.type == "attempt.started":
            data: Any = event.data
            if committed is not None and data.restore_id not in committed:
                continue
            restores.pop(0)
            if event.attempt > state.attempt:
                state.continue_at_cut(event.attempt)
            else:
                state.unpin()
            continue
        record = encode_record(event)
        meta, start = peek_record(record)
        state.observe(offset, meta, record, start)
    return state


def capture(state: EpisodeFold, marker: int) -> tuple[Any, ...] | None:
    """The manifest entry the projector captures for this state at a marker."""
    projector = Projector(None, "run", 1)  # type: ignore[arg-type]
    projector.trackers[state.episode] = state  # type: ignore[assignment]
    projector.by_partition[0][state.episode] = state  # type: ignore[assignment]
    checkpoint = CheckpointCapture(1, frozenset({0}))
    projector._capture_partition(checkpoint, 0, marker)
    entry = checkpoint.entries.get(state.episode)
    if entry is None:
        return None
    waiting = state.episode in checkpoint.waiting
    return (entry.action, entry.cut_offset, entry.staging_keys, entry.last_stage, waiting)


def metadata(state: EpisodeFold | EpisodeProjection) -> dict[str, Any]:
    """What both modes know of a projection."""
    if isinstance(state, EpisodeFold):
        cut = None if state.finished else state.generation_cut()
        return {
            "attempt": state.attempt,
            "finished": state.finished,
            "first_offset": state.first_offset,
            "committed_through": state.committed_through,
            "open_waits": dict(state.open_waits),
            "last_stage": state.last_stage,
            "sessions": {sid: s.mode for sid, s in state.sessions.items()},
            "restart_only": state.restart_only_open,
            "staging_keys": state.referenced_staging_keys(),
            "payload_bytes": state.payload_bytes(),
            "cut": None if cut is None else (cut.call_id, cut.terminal, cut.problem),
        }
    cut = state.generation_cut
    return {
        "attempt": state.attempt,
        "finished": state.status == "finished",
        "first_offset": state.first_offset,
        "committed_through": state.committed_through,
        "open_waits": dict(state.open_waits),
        "last_stage": state.last_stage,
        "sessions": {sid: s.mode for sid, s in state.sessions.items()},
        "restart_only": bool(state.restart_only_sessions()),
        "staging_keys": state.staging_keys,
        "payload_bytes": state.payload_bytes,
        "cut": None if cut is None else (cut.call_id, cut.terminal, cut.problem),
    }


def check_both_modes(
    episode: str,
    events: Sequence[tuple[int, Event]],
    cut: int,
    committed: Container[int] | None = None,
) -> EpisodeProjection:
    """Assert that both modes agree; return the full fold's projection."""
    projection = project_events(episode, events, cut, committed)
    tracker = follow(episode, events, cut, committed, keep_payloads=False)
    full = follow(episode, events, cut, committed, keep_payloads=True)
    want = metadata(projection)
    for mode, got in (
        ("tracker", metadata(tracker)),
        ("full", metadata(full)),
        ("full projection", metadata(full.projection(cut))),
    ):
        differs = {key: (got[key], want[key]) for key in want if got[key] != want[key]}
        assert not differs, f"{mode}: {differs}"
    # The same manifest entry from either mode.
    assert capture(tracker, cut) == capture(full, cut)
    # The same verdict: the tracker's (kept as the records came) and the full fold's.
    verdict = verify_projection(projection)
    assert full.verdict() == verdict
    if tracker.exact:
        assert tracker.verdict() == verdict
    return projection
