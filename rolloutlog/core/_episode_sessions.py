"""The fold's rules for sessions (committing their changes at a boundary, export-on-checkpoint
sessions) and for agent delta boundaries, kept beside ``_episode.py`` (``EpisodeFold`` inherits
them; they read and write its fields)."""

from __future__ import annotations

import sys
from typing import Any

from rolloutlog.core._deltas import compose_state
from rolloutlog.core._model import BoundaryView, SessionView
from rolloutlog.core._opaque import Opaque

__all__ = ["SessionRules"]

_new = tuple.__new__
intern = sys.intern


class SessionRules:
    """Session changes committed, delta boundaries (``rolloutlog.core._deltas``) and
    ``checkpoint`` sessions' exports."""

    # Set by ``EpisodeFold._clear``; here as they are replaced here (None until the first).
    __slots__ = (
        "_pending_sessions",
        "boundary_deltas",
        "exports",
        "restart_only_open",
        "session_offsets",
    )
    boundary_deltas: dict[str, tuple[bytes | memoryview, ...]] | None
    exports: dict[str, tuple[int, bool, bool]] | None
    #: Per open session with a recorded state, the offset of the record its state is read from
    #: (None until the first): where a restore reads the state when it composes a projection
    #: from the records (``EpisodeFold.composition``) rather than folding them again.
    session_offsets: dict[str, int] | None
    boundaries: dict[str, BoundaryView]
    boundary_bytes: dict[str, int]
    sessions: dict[str, SessionView]
    session_bytes: dict[str, int]
    finished: bool
    restart_only_open: bool
    _pending_sessions: (
        list[tuple[str, dict[str, Any], bytes | None, int, dict[str, Any], int]] | None
    )

    def _commit_sessions(self) -> None:
        """A boundary commits the tail's session changes (the views, their sizes, and whether a
        ``restart_only`` session is open)."""
        sessions, sizes = self.sessions, self.session_bytes
        offsets = self.session_offsets
        modes_changed = False
        for kind, data, kept, size, who, offset in self._pending_sessions or ():
            sid = data["session_id"]
            if kind == "session.state":
                state = Opaque(kept) if kept is not None else None
                current = sessions.get(sid)
                if current is None:
                    # State of a session whose start was not recorded: it fails closed.
                    view = (sid, who["kind"], who["id"], "restart_only", "wait", state)
                    modes_changed = True
                elif current[3] == "checkpoint":
                    continue  # a change mark: the state is the export's
                elif state is current[5]:  # no state kept (sizes only): the view stands
                    view = None
                else:
                    view = (sid, current[1], current[2], current[3], current[4], state)
                if view is not None:
                    sessions[sid] = _new(SessionView, view)
                sizes[sid] = size
                if offsets is None:
                    self.session_offsets = offsets = {}
                offsets[sid] = offset
            elif kind == "session.started":
                mode = intern(data.get("mode", "restart_only"))
                verify = intern(data.get("verify", "wait"))
                sid = intern(sid)
                view = (sid, intern(who["kind"]), intern(who["id"]), mode, verify, None)
                sessions[sid] = _new(SessionView, view)
                sizes[sid] = 0
                if offsets:
                    offsets.pop(sid, None)
                modes_changed = True
            else:
                sessions.pop(sid, None)
                sizes.pop(sid, None)
                if offsets:
                    offsets.pop(sid, None)
                modes_changed = True
        self._pending_sessions = None
        if modes_changed:
            restart_only = False
            for session in sessions.values():
                if session[3] == "restart_only":
                    restart_only = True
                    break
            self.restart_only_open = restart_only

    def _delta_boundary(
        self,
        owner: str,
        data: dict[str, Any],
        meta: dict[str, Any],
        offset: int,
        delta: Opaque | None,
        size: int,
    ) -> None:
        """A boundary whose state is a delta (``rolloutlog.core._deltas``): the owner's view keeps
        its last whole state and the deltas since wait beside it, composed when a projection is
        built (a restore or a read), never on the projector's path."""
        previous = self.boundaries.get(owner)
        base = previous.state if previous is not None else None
        view = (data["stage"], data.get("next"), base, meta.get("step"), offset)
        self.boundaries[owner] = _new(BoundaryView, view)
        self.boundary_bytes[owner] = self.boundary_bytes.get(owner, 0) + size
        deltas = self.boundary_deltas
        if deltas is None:
            self.boundary_deltas = deltas = {}
        # Without payloads (a tracker) each delta leaves an empty mark: the owner's state is then
        # not its view's record alone, which a composition (``core._compose``) must know.
        deltas[owner] = (*deltas.get(owner, ()), delta.raw if delta is not None else b"")

    def _composed_boundaries(self) -> dict[str, BoundaryView]:
        """The boundaries with each owner's deltas composed onto its last whole state."""
        boundaries = dict(self.boundaries)
        for owner, deltas in (self.boundary_deltas or {}).items():
            view = boundaries[owner]
            base = view.state.raw if view.state is not None else None
            boundaries[owner] = view._replace(state=Opaque(compose_state(base, deltas)))
        return boundaries

    # -- export-on-checkpoint sessions (mode ``checkpoint``) -----------------------------------
    #
    # Such a session writes a change mark (``session.state`` without a checkpoint id) before each
    # reply and its state only when a checkpoint asks (``session.state`` with the checkpoint's
    # id). An export is the session's state at once (never in the tail), and it matches the
    # committed prefix when none of the session's change marks is uncommitted: at the export,
    # or at the next boundary if marks were pending then (that boundary commits them) and no
    # mark came after the export. ``exports``: session → (checkpoint id, waits for a boundary,
    # changed after the export).

    def _export(self, data: dict[str, Any], kept: bytes | None, size: int, offset: int) -> None:
        sid = data["session_id"]
        current = self.sessions.get(sid)
        if current is None:  # not open in the committed prefix: its episode replays the opening
            return
        state = Opaque(kept) if kept is not None else None
        view = (sid, current[1], current[2], current[3], current[4], state)
        self.sessions[sid] = _new(SessionView, view)
        self.session_bytes[sid] = size
        if self.session_offsets is None:
            self.session_offsets = {}
        self.session_offsets[sid] = offset
        marks = any(c[1]["session_id"] == sid for c in self._pending_sessions or ())
        if self.exports is None:
            self.exports = {}
        self.exports[sid] = (data["checkpoint_id"], marks, False)

    def _export_changed(self, sid: str) -> None:
        exports = self.exports
        if exports is not None:  # (asked only of a session it holds)
            checkpoint_id, waits, _ = exports[sid]
            exports[sid] = (checkpoint_id, waits, True)

    def export_owners(self) -> set[str]:
        """The wait owners (``export:<session>``) of the open ``checkpoint`` sessions."""
        return {f"export:{s[0]}" for s in self.sessions.values() if s[3] == "checkpoint"}

    def export_missing(self, owners: set[str], checkpoint_id: int) -> list[str]:
        """The sessions among ``owners`` (``export:<session>``) still open without an export for
        ``checkpoint_id`` that matches the committed prefix (none once the episode finished: a
        finished episode restores nothing)."""
        missing: list[str] = []
        if self.finished:
            return missing
        for owner in owners:
            if owner.startswith("export:"):
                sid = owner[7:]
                if sid not in self.sessions:
                    continue  # ended since: nothing to restore
                found = self.exports.get(sid) if self.exports else None
                if found is None or found[0] != checkpoint_id or found[1] or found[2]:
                    missing.append(sid)
        return missing
