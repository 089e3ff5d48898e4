"""What the projector keeps per live episode: just enough for a manifest, never the states.

``EpisodeTracker`` applies the fold's rules (``_fold``) to metadata, incrementally: the filters
are the fold's own, and the committed-prefix/tail split works the same way, but it keeps session
modes, staging keys, offsets and sizes instead of states, ledgers and token arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutlog.projections._fold import _Filters
from rolloutlog.projections._model import EpisodeProjection


@dataclass(slots=True)
class EpisodeTracker:
    episode: str
    partition: int
    attempt: int = 0
    first_offset: int | None = None
    first_ts: float | None = None
    finished: bool = False
    finished_offset: int | None = None
    last_boundary_offset: int | None = None
    last_stage: str | None = None
    size_bytes: int = 0
    open_waits: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)  # session id → mode
    staging_keys: list[str] = field(default_factory=list)
    filters: _Filters = field(default_factory=_Filters)
    _pending_sessions: list[tuple[str, str, str]] = field(default_factory=list)
    _pending_staging: list[str] = field(default_factory=list)
    _tail_staging: str | None = None
    #: Derived at each change so that capturing 16,000 entries at a marker only reads fields.
    restart_only_open: bool = False
    _staging: tuple[str, ...] | None = None

    def observe(self, offset: int, meta: dict[str, Any], size: int) -> None:
        """Filter (zombies, duplicates, fenced attempts) and apply one record of this episode;
        markers and ``attempt.started`` are the projector's to handle."""
        if self.filters.admits(meta):
            self.apply(offset, meta, size)

    def apply(self, offset: int, meta: dict[str, Any], size: int) -> None:
        """Apply a record the filters already admitted."""
        if self.first_offset is None:
            self.first_offset = offset
            self.first_ts = meta.get("ts")
        self.size_bytes += size
        kind = meta["type"]
        data = meta["data"]
        if kind == "step.boundary":
            owner = data["owner"]
            self.open_waits.pop(owner, None)
            self._commit(offset)
            if owner == "environment":
                self.last_stage = data["stage"]
        elif kind == "step.started":
            if data.get("mode", "wait") == "wait":
                self.open_waits[data["owner"]] = offset
            else:
                self.open_waits.pop(data["owner"], None)
        elif kind == "session.started":
            self._pending_sessions.append(
                ("start", data["session_id"], data.get("mode", "restart_only"))
            )
        elif kind == "session.ended":
            self._pending_sessions.append(("end", data["session_id"], ""))
        elif kind == "session.state":
            self._pending_sessions.append(("state", data["session_id"], "restart_only"))
        elif kind == "ledger.row":
            if data.get("staging_key"):
                self._pending_staging.append(data["staging_key"])
        elif kind == "generation.chunk":
            key = data.get("staging_key")
            if key != self._tail_staging:
                self._tail_staging = key
                self._staging = None
        elif kind == "episode.started":
            self._commit(offset)
        elif kind == "episode.finished":
            self.finished = True
            self.finished_offset = offset

    def _commit(self, offset: int) -> None:
        for op, sid, mode in self._pending_sessions:
            if op == "start":
                self.sessions[sid] = mode
            elif op == "end":
                self.sessions.pop(sid, None)
            else:
                self.sessions.setdefault(sid, mode)
        self._pending_sessions.clear()
        for key in self._pending_staging:
            if key not in self.staging_keys:
                self.staging_keys.append(key)
        self._pending_staging.clear()
        self._tail_staging = None
        self._staging = None
        self.last_boundary_offset = offset
        self.restart_only_open = "restart_only" in self.sessions.values()

    def restart_only(self) -> bool:
        return self.restart_only_open

    def referenced_staging_keys(self) -> tuple[str, ...]:
        """Committed rows' staging keys and the in-flight call's (in order, without repeats)."""
        staging = self._staging
        if staging is None:
            if not self._tail_staging or self._tail_staging in self.staging_keys:
                staging = tuple(self.staging_keys)
            else:
                staging = (*self.staging_keys, self._tail_staging)
            self._staging = staging
        return staging

    def restart(self, attempt: int) -> None:
        """A restore started this episode over as ``attempt``: nothing carries on."""
        self._reset(attempt, None, None, None, {}, {}, [], None, 0)

    def continue_from(self, projection: EpisodeProjection, attempt: int) -> None:
        """A restore continues this episode as ``attempt`` from ``projection`` (its cut)."""
        cut = projection.generation_cut
        self._reset(
            attempt,
            projection.first_offset,
            projection.committed_through,
            projection.last_stage,
            dict(projection.open_waits),
            {sid: s.mode for sid, s in projection.sessions.items()},
            list(dict.fromkeys(row.staging_key for row in projection.ledger if row.staging_key)),
            cut.staging_key if cut is not None else None,
            projection.payload_bytes,
        )

    def _reset(
        self,
        attempt: int,
        first_offset: int | None,
        last_boundary_offset: int | None,
        last_stage: str | None,
        open_waits: dict[str, int],
        sessions: dict[str, str],
        staging_keys: list[str],
        tail_staging: str | None,
        size_bytes: int,
    ) -> None:
        # Field by field: a restore resets thousands of trackers while the partition waits.
        self.filters.attempt = attempt
        self.attempt = attempt
        self.first_offset = first_offset
        self.first_ts = None
        self.finished = False
        self.finished_offset = None
        self.last_boundary_offset = last_boundary_offset
        self.last_stage = last_stage
        self.size_bytes = size_bytes
        self.open_waits = open_waits
        self.sessions = sessions
        self.staging_keys = staging_keys
        self._pending_sessions = []
        self._pending_staging = []
        self._tail_staging = tail_staging
        self._staging = None
        self.restart_only_open = "restart_only" in sessions.values()
