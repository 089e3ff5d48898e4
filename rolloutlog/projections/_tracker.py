"""What the projector keeps per live episode: just enough for a manifest and a restore's verdict,
never the states.

``EpisodeTracker`` applies the fold's rules (``_fold``) to metadata, incrementally: the filters
are the fold's own, and the committed-prefix/tail split works the same way, but it keeps session
modes, staging keys, offsets and sizes instead of states, ledgers and token arrays. It also checks
each ledger row's lineage as the row arrives (``_verify.ledger_row_problem``, on the raw token
array, which it then drops), so that a restore of a checkpoint this projector captured has the
verdict of every untouched episode without replaying its records (``verdict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutlog.log import task_digest, token_count
from rolloutlog.projections._fold import _Filters
from rolloutlog.projections._model import EpisodeProjection
from rolloutlog.projections._verify import generation_cut_problem, ledger_row_problem

_SEPARATOR = b"\n"

#: A ledger row in the tail: (call id, digest, cum_len, policy version, problem or None).
_Row = tuple[str, str, int, int, "str | None"]
#: A generation chunk in the tail: (start, token count, done, parent call id, policy version).
_Chunk = tuple[int, int, bool, "str | None", int]


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
    _pending_sessions: list[tuple[str, str, str, int]] = field(default_factory=list)
    _pending_staging: list[str] = field(default_factory=list)
    _tail_staging: str | None = None
    #: Derived at each change so that capturing 16,000 entries at a marker only reads fields.
    restart_only_open: bool = False
    _staging: tuple[str, ...] | None = None
    #: Bumped by every change: a capture notes it, a restore compares (nothing moved since?).
    version: int = 0
    #: False when the state is not exactly the fold's at the same position (a restore reset it
    #: from a projection, which drops the tail): its verdict then comes from a replay.
    exact: bool = True
    # What ``verify_projection`` would say, kept as the records arrive.
    task_seen: bool = False
    task_problem: str | None = None
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)  # call id → (digest, cum_len)
    ledger_problem: str | None = None
    # Payload sizes of the committed prefix (what ``EpisodeProjection.payload_bytes`` counts).
    task_bytes: int = 0
    boundary_bytes: dict[str, int] = field(default_factory=dict)
    session_bytes: dict[str, int] = field(default_factory=dict)
    _pending_rows: list[_Row] = field(default_factory=list)
    _tail_chunks: dict[str, list[_Chunk]] = field(default_factory=dict)
    _tail_constrained: set[str] = field(default_factory=set)
    _latest_call: str | None = None
    #: Set while a restore plans from this state (``pin``): the first change copies it first.
    pinned: bool = False
    _state_at_pin: EpisodeTracker | None = None
    #: ``verdict``'s answer while the state stays as it is (a restore does not change it).
    _verdict: tuple[str | None] | None = None

    def observe(self, offset: int, meta: dict[str, Any], record: bytes) -> None:
        """Filter (zombies, duplicates, fenced attempts) and apply one record of this episode;
        markers and ``attempt.started`` are the projector's to handle."""
        if self.filters.admits(meta):
            self.apply(offset, meta, record)

    def apply(self, offset: int, meta: dict[str, Any], record: bytes) -> None:
        """Apply a record the filters already admitted (``record``: its bytes as logged)."""
        if self.pinned:
            self._keep_pinned_state()
        self.version += 1
        self._verdict = None
        if self.first_offset is None:
            self.first_offset = offset
            self.first_ts = meta.get("ts")
        self.size_bytes += len(record)
        kind = meta["type"]
        data = meta["data"]
        if kind == "step.boundary":
            owner = data["owner"]
            self.open_waits.pop(owner, None)
            self._commit(offset)
            self.boundary_bytes[owner] = _payload_size(record)
            if owner == "environment":
                self.last_stage = data["stage"]
        elif kind == "step.started":
            if data.get("mode", "wait") == "wait":
                self.open_waits[data["owner"]] = offset
            else:
                self.open_waits.pop(data["owner"], None)
        elif kind == "session.started":
            self._pending_sessions.append(
                ("start", data["session_id"], data.get("mode", "restart_only"), 0)
            )
        elif kind == "session.ended":
            self._pending_sessions.append(("end", data["session_id"], "", 0))
        elif kind == "session.state":
            self._pending_sessions.append(
                ("state", data["session_id"], "restart_only", _payload_size(record))
            )
        elif kind == "ledger.row":
            self._ledger_row(data, record)
        elif kind == "generation.chunk":
            self._chunk(data, record)
        elif kind == "episode.started":
            self._commit(offset)
            self._task(data, record)
        elif kind == "episode.finished":
            self.finished = True
            self.finished_offset = offset

    def _ledger_row(self, data: dict[str, Any], record: bytes) -> None:
        if data.get("staging_key"):
            self._pending_staging.append(data["staging_key"])
        call_id = data["call_id"]
        if data.get("constrained"):
            self._tail_constrained.add(call_id)
        self._latest_call = call_id
        # The rows before this one in the eventual ledger: the committed ones, then the tail's.
        earlier = self.rows
        if self._pending_rows:
            earlier = {**earlier, **{row[0]: (row[1], row[2]) for row in self._pending_rows}}
        try:
            problem = ledger_row_problem(
                data.get("parent_call_id"),
                data["prev_len"],
                data["cum_len"],
                data["digest"],
                _payload(record) or b"[]",
                earlier,
            )
        except Exception:  # the fold would fail on it too: leave this episode to a replay
            self.exact = False
            problem = None
        self._pending_rows.append(
            (call_id, data["digest"], data["cum_len"], data["policy_version"], problem)
        )

    def _chunk(self, data: dict[str, Any], record: bytes) -> None:
        key = data.get("staging_key")
        if key != self._tail_staging:
            self._tail_staging = key
            self._staging = None
        call_id = data["call_id"]
        payload = _payload(record)
        self._tail_chunks.setdefault(call_id, []).append(
            (
                data["start"],
                token_count(payload) if payload is not None else 0,
                bool(data.get("done")),
                data.get("parent_call_id"),
                data["policy_version"],
            )
        )
        self._latest_call = call_id

    def _task(self, data: dict[str, Any], record: bytes) -> None:
        payload = _payload(record)
        self.task_bytes = len(payload) if payload is not None else 0
        digest = data.get("task_digest")
        self.task_seen = payload is not None and digest is not None
        self.task_problem = None
        if self.task_seen:
            try:
                if task_digest(payload) != digest:
                    self.task_problem = "task digest does not match the task"
            except Exception:  # the fold would fail on it too: leave this episode to a replay
                self.exact = False

    def _commit(self, offset: int) -> None:
        for op, sid, mode, size in self._pending_sessions:
            if op == "start":
                self.sessions[sid] = mode
                self.session_bytes[sid] = 0
            elif op == "end":
                self.sessions.pop(sid, None)
                self.session_bytes.pop(sid, None)
            else:
                self.sessions.setdefault(sid, mode)
                self.session_bytes[sid] = size
        self._pending_sessions.clear()
        for key in self._pending_staging:
            if key not in self.staging_keys:
                self.staging_keys.append(key)
        self._pending_staging.clear()
        for call_id, digest, cum_len, _, problem in self._pending_rows:
            if problem is not None and self.ledger_problem is None:
                self.ledger_problem = f"ledger row {call_id}: {problem}"
            self.rows[call_id] = (digest, cum_len)
        self._pending_rows.clear()
        self._tail_chunks.clear()
        self._tail_constrained.clear()
        self._latest_call = None
        self._tail_staging = None
        self._staging = None
        self.last_boundary_offset = offset
        self.restart_only_open = "restart_only" in self.sessions.values()

    # -- reading -----------------------------------------------------------------------------

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

    def payload_bytes(self) -> int:
        return (
            self.task_bytes + sum(self.boundary_bytes.values()) + sum(self.session_bytes.values())
        )

    def generation_cut(self) -> tuple[str, str | None, str | None, int] | None:
        """The tail's generation cut as ``EpisodeFold.generation_cut`` finds it, by token counts:
        (call id, problem, parent call id, policy version), or None."""
        call = self._latest_call
        if call is None or call in self._tail_constrained:
            return None
        chunks = self._tail_chunks.get(call)
        if not chunks:
            return None
        by_start: dict[int, _Chunk] = {}
        for chunk in chunks:
            by_start.setdefault(chunk[0], chunk)
        length, terminal = 0, False
        problem = None if 0 in by_start else "chunks do not start at 0"
        last = next(iter(by_start.values()))
        while length in by_start and not terminal:
            chunk = by_start[length]
            if not chunk[1] and not chunk[2]:
                break
            length += chunk[1]
            terminal = chunk[2]
            last = chunk
        if problem is None and any(start > length for start in by_start):
            problem = f"chunks are not contiguous after token {length}"
        return call, problem, last[3], last[4]

    def verdict(self) -> str | None:
        """What ``verify_projection`` says of this episode's projection at this position: why it
        cannot continue, or None. Meaningful only while ``exact``."""
        if self._verdict is None:
            self._verdict = (self._judge(),)
        return self._verdict[0]

    def _judge(self) -> str | None:
        if not self.task_seen:
            return "no episode.started before the cut"
        if self.task_problem is not None:
            return self.task_problem
        if self.ledger_problem is not None:
            return self.ledger_problem
        cut = None if self.finished else self.generation_cut()
        if cut is not None:
            return generation_cut_problem(cut[0], cut[1], cut[2], self.rows)
        return None

    def pin(self) -> None:
        """A restore plans from this state: keep it (copied on the next change) until
        ``unpin``."""
        self.pinned = True
        self._state_at_pin = None

    def pinned_state(self) -> EpisodeTracker:
        """The state as it was at ``pin``."""
        return self._state_at_pin or self

    def unpin(self) -> EpisodeTracker:
        """The state as it was at ``pin`` (this tracker itself if nothing changed since)."""
        state = self._state_at_pin or self
        self.pinned = False
        self._state_at_pin = None
        return state

    def _keep_pinned_state(self) -> None:
        self.pinned = False
        self._state_at_pin = self.snapshot()

    def snapshot(self) -> EpisodeTracker:
        """A copy of this state (filters excepted) that later records do not change."""
        copy = EpisodeTracker(
            self.episode,
            self.partition,
            self.attempt,
            self.first_offset,
            self.first_ts,
            self.finished,
            self.finished_offset,
            self.last_boundary_offset,
            self.last_stage,
            self.size_bytes,
            dict(self.open_waits),
            dict(self.sessions),
            list(self.staging_keys),
            self.filters,
            list(self._pending_sessions),
            list(self._pending_staging),
            self._tail_staging,
            self.restart_only_open,
            self._staging,
            self.version,
            self.exact,
            self.task_seen,
            self.task_problem,
            dict(self.rows),
            self.ledger_problem,
            self.task_bytes,
            dict(self.boundary_bytes),
            dict(self.session_bytes),
            list(self._pending_rows),
            {call: list(chunks) for call, chunks in self._tail_chunks.items()},
            set(self._tail_constrained),
            self._latest_call,
            _verdict=self._verdict,
        )
        return copy

    # -- restores ------------------------------------------------------------------------------

    def restart(self, attempt: int) -> None:
        """A restore started this episode over as ``attempt``: nothing carries on."""
        self._reset(attempt, None, None, None, {}, {}, [], None, 0)
        self.exact = True

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
        # A projection has no tail (pending sessions, rows, chunks): later verdicts replay.
        self.exact = False

    def continue_from_pin(self, attempt: int) -> None:
        """A restore continues this episode as ``attempt`` from its state at the cut, which
        ``pin`` kept (what the fold of the new attempt starts from: the old attempt's committed
        prefix and its tail's generation cut; the tail's session changes and undelivered calls
        are dropped, as the fold drops them at ``attempt.started``)."""
        state = self.unpin()
        version = self.version
        if state is not self:
            filters = self.filters
            for name in _STATE_FIELDS:
                setattr(self, name, getattr(state, name))
            self.filters = filters
        self._pending_sessions = []
        self._pending_staging = []
        self._pending_rows = []
        self.filters.attempt = attempt
        self.attempt = attempt
        self.version = version + 1
        self.first_ts = None
        self.finished = False
        self.finished_offset = None
        self.size_bytes = self.payload_bytes()

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
        self.pinned = False
        self._state_at_pin = None
        self._verdict = None
        self.version += 1
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
        self.task_seen = False
        self.task_problem = None
        self.rows = {}
        self.ledger_problem = None
        self.task_bytes = 0
        self.boundary_bytes = {}
        self.session_bytes = {}
        self._pending_rows = []
        self._tail_chunks = {}
        self._tail_constrained = set()
        self._latest_call = None


#: The fields a snapshot carries over (everything but identity, filters and the version).
_STATE_FIELDS = tuple(
    name
    for name in EpisodeTracker.__slots__
    if name not in ("episode", "partition", "filters", "version", "pinned", "_state_at_pin")
)


def _payload(record: bytes) -> bytes | None:
    cut = record.find(_SEPARATOR)
    return None if cut < 0 else record[cut + 1 :]


def _payload_size(record: bytes) -> int:
    cut = record.find(_SEPARATOR)
    return 0 if cut < 0 else len(record) - cut - 1
