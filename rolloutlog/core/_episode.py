"""The fold's state machine: one episode's events applied one record at a time (docs/design.md
§4, §5). No I/O. ``_fold`` runs it over an episode's records (the full fold); the projector keeps
one per live episode without payloads (``_tracker``).

Beside it, each with one job: the record filters (``_filters``), the session rules it inherits
(``_episode_sessions``), the tail's generation cut (``_tail``), the copies a pin keeps
(``_pins``), and the restore transition (``_restore``), which ``begin_attempt`` runs.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from rolloutlog.core._deltas import is_delta
from rolloutlog.core._digests import token_count
from rolloutlog.core._episode_sessions import SessionRules
from rolloutlog.core._filters import EventFilters
from rolloutlog.core._model import (
    BoundaryView,
    EpisodeProjection,
    GenerationCut,
    LedgerEntry,
    SessionView,
)
from rolloutlog.core._opaque import SPLICE_BYTES, Opaque
from rolloutlog.core._pins import snapshot
from rolloutlog.core._planner import restart_only_reason
from rolloutlog.core._restore import AttemptRules
from rolloutlog.core._tail import Chunk, CutChunks, cut_chunks, generation_cut
from rolloutlog.core._verify import Lineage, verify_projection

__all__ = ["CutDecision", "EpisodeFold", "EventFilters"]

_new = tuple.__new__
intern = sys.intern


#: What a checkpoint's manifest says of an episode at its cut (``EpisodeFold.at_cut``): its
#: action, why it restarts (for ``restart``), and whether the cut waits for the next boundary of
#: the owners of the open wait steps (the entry is ``continue`` until then).
CutDecision = tuple[str, str | None, bool]

_FINISHED: CutDecision = ("finished", None, False)
_CONTINUE: CutDecision = ("continue", None, False)
_WAIT: CutDecision = ("continue", None, True)
_NOTHING_YET: CutDecision = ("restart", "the attempt has recorded nothing yet", False)

#: A pending session change: (type, data, state's raw JSON when kept, state's size, writer, its
#: record's offset).
_SessionChange = tuple[str, dict[str, Any], bytes | None, int, dict[str, Any], int]
_NO_CALLS: frozenset[str] = frozenset()


class EpisodeFold(AttemptRules):
    """One episode's state machine: every rule of the fold, applied one record at a time.

    It runs in two modes, chosen by ``keep_payloads`` — what it keeps, never which rules apply:

    - ``True`` (the full fold, for restores and reads): states, the task, ledger rows with their
      token ids; ``projection()`` gives the ``EpisodeProjection``, which ``verify_projection``
      judges from the kept bytes.
    - ``False`` (the projector's trackers, one per live episode): sizes instead of states, and each
      ledger row's lineage checked as it arrives (``Lineage``) before its token ids are dropped;
      ``verdict()`` is then what ``verify_projection`` would say of the projection, without one.

    Changes to sessions and the ledger wait in the tail until the next boundary commits them, so
    the committed prefix and the tail come out of one pass. Records come whole (``apply``'s
    ``record`` and the ``start`` of its payload), or as a payload alone (``start`` 0).
    """

    __slots__ = (
        "_cut_staging",
        "_pending_ledger",
        "_pending_ledger_offsets",
        "_pending_staging",
        "_state_at_pin",
        "_tail_chunks",
        "_tail_constrained",
        "boundaries",
        "boundary_bytes",
        "episode",
        "events",
        "keep_payloads",
        "ledger_offsets",
        "lineage",
        "pinned",
        "result",
        "reward",
        "session_bytes",
        "sessions",
        "staging_keys",
        "task_offset",
    )

    #: The fields that make the state (set below the class).
    STATE_FIELDS: ClassVar[tuple[str, ...]]

    def __init__(self, episode: str, attempt: int = 0, *, keep_payloads: bool = True) -> None:
        self.episode = episode
        self.keep_payloads = keep_payloads
        self.filters = EventFilters(attempt)
        self.version = 0
        self._clear(attempt)

    def _clear(self, attempt: int) -> None:
        """An empty state of ``attempt`` (identity, filters and version stay)."""
        self.attempt = attempt
        self.filters.current_attempt = attempt
        self.first_offset: int | None = None
        self.first_ts: float | None = None
        self.task: Opaque | None = None
        #: The offset of the ``episode.started`` record the task is read from.
        self.task_offset: int | None = None
        self.task_digest: str | None = None
        self.deadline_s: float | None = None
        self.boundaries: dict[str, BoundaryView] = {}
        #: Per owner, the delta states (raw) since its view's whole state, in log order (None
        #: until the first: most episodes never have one, and an empty dict is 64 bytes each).
        self.boundary_deltas = None
        #: The stage of the environment's latest boundary.
        self.last_stage: str | None = None
        self.sessions: dict[str, SessionView] = {}
        self.session_offsets = None
        #: Exports of ``checkpoint`` sessions (see ``SessionRules._export``; None until the first).
        self.exports = None
        #: A ``restart_only`` session is open in the committed prefix.
        self.restart_only_open = False
        #: Committed ledger rows (kept with payloads only, else None: ``lineage`` judges them).
        self.ledger: list[LedgerEntry] | None = [] if self.keep_payloads else None
        #: The committed rows' record offsets, in ledger order (None until the first): with the
        #: other positions kept here (``task_offset``, the boundaries' offsets,
        #: ``session_offsets``, the tail's chunks'), what ``composition`` reads a projection from.
        self.ledger_offsets: list[int] | None = None
        #: The committed rows' staging keys, in order, without repeats.
        self.staging_keys: list[str] = []
        self.lineage: Lineage | None = None if self.keep_payloads else Lineage()
        self.open_waits: dict[str, int] = {}
        self.committed_through: int | None = None
        self.finished = False
        self.finished_offset: int | None = None
        self.reward: float | None = None
        self.result: Opaque | None = None
        self.events = 0
        #: Bytes of the records applied (whole records when given them).
        self.size_bytes = 0
        # Payload sizes of the committed prefix (what ``EpisodeProjection.payload_bytes`` counts).
        self.task_bytes = 0
        self.boundary_bytes: dict[str, int] = {}
        self.session_bytes: dict[str, int] = {}
        #: False when this state is not exactly the fold's at its position (a check could not
        #: run, or a restore reset it from a projection, which has no tail): judge it by a replay.
        self.exact = True
        self.pinned = False
        self._state_at_pin: EpisodeFold | None = None
        # The tail: changes not yet committed by a boundary (the lists None while empty: a live
        # episode mostly waits with none, and each empty list was 56 bytes).
        self._pending_sessions: list[_SessionChange] | None = None
        self._pending_ledger: list[LedgerEntry] | None = [] if self.keep_payloads else None
        self._pending_ledger_offsets: list[int] | None = None
        self._pending_staging: list[str] | None = None
        # (One list for every call rather than a list per call: a live episode's tail mostly
        # holds one call's chunks, and a dict of lists cost it ~190 bytes more.)
        self._tail_chunks: list[Chunk] = []
        # (Replaced, never changed in place: shared empty by the many episodes without one.)
        self._tail_constrained: frozenset[str] = _NO_CALLS
        self._latest_call: str | None = None
        # The generation cut's staging key, noted as its only chunk arrives (a manifest reads it
        # for every episode, and a lookup through the tail costs a capture 2 us per episode at
        # scale); otherwise ``_cut_chunks`` finds it when asked.
        self._cut_staging: str | None = None
        self._cut_staging_known = True
        # Answers kept while the state stays as it is (every change clears them).
        self._staging: tuple[str, ...] | None = None
        self._verdict: tuple[str | None] | None = None

    # -- applying records ------------------------------------------------------------------

    def observe(self, offset: int, meta: dict[str, Any], record: bytes, start: int) -> bool:
        """Filter (zombies, duplicates, fenced attempts: rules 3-5) and apply one record of this
        episode; whether it was applied. Markers and ``attempt.started`` are the caller's."""
        if self.filters.admits(meta):
            self.apply(offset, meta, record, start)
            return True
        return False

    def apply(self, offset: int, meta: dict[str, Any], record: bytes, start: int) -> None:
        """Apply a record the filters admitted: ``record[start:]`` is its payload's raw JSON
        (none when ``start == len(record)``)."""
        if self.pinned:
            self._keep_pinned_state()
        self.version += 1
        self._verdict = None
        self._staging = None
        kind = meta["type"]
        if kind == "attempt.started":
            # A restore continued the projection at its cut (``_restore.select_records`` kept
            # the records below it): the tail's session changes and undelivered calls were
            # dropped, so the next boundary must not commit them; the generation cut stays until
            # the new attempt commits past it.
            self._drop_tail()
            return
        if self.first_offset is None:
            self.first_offset = offset
            self.first_ts = meta.get("ts")
        self.events += 1
        self.size_bytes += len(record)
        data = meta["data"]
        if kind == "step.boundary":
            # The names a view keeps are interned: every episode repeats the same few.
            owner = intern(data["owner"])
            self.open_waits.pop(owner, None)
            self._commit(offset)
            # (The views are built as plain tuples: a fold builds them by the hundred thousand.)
            state = (
                Opaque(record[start:] if start else record)
                if self.keep_payloads and start < len(record)
                else None
            )
            if start < len(record) and is_delta(record, start):
                self._delta_boundary(owner, data, meta, offset, state, len(record) - start)
            else:
                following = data.get("next")
                if following is not None:
                    following = intern(following)
                view = (intern(data["stage"]), following, state, meta.get("step"), offset)
                self.boundaries[owner] = _new(BoundaryView, view)
                self.boundary_bytes[owner] = len(record) - start
                deltas = self.boundary_deltas
                if deltas and owner in deltas:
                    del deltas[owner]
            if owner == "environment":
                self.last_stage = self.boundaries[owner][0]
        elif kind == "step.started":
            if data.get("mode", "wait") == "wait":
                self.open_waits[data["owner"]] = offset
            else:
                self.open_waits.pop(data["owner"], None)
        elif kind == "ledger.row":
            self._ledger_row(data, record, start)
            if self._pending_ledger_offsets is None:
                self._pending_ledger_offsets = [offset]
            else:
                self._pending_ledger_offsets.append(offset)
        elif kind == "generation.chunk":
            call_id = intern(data["call_id"])
            parent = data.get("parent_call_id")
            payload = record[start:] if start else record
            tokens = token_count(payload) if start < len(record) else 0
            kept = payload if self.keep_payloads and start < len(record) else None
            staging_key = data.get("staging_key")
            facts = (
                intern(parent) if parent is not None else None,
                data["request_digest"],
                data["policy_version"],
                staging_key,
            )
            chunk = (data["start"], tokens, bool(data.get("done")), facts, kept, call_id, offset)
            tail = self._tail_chunks
            # Its call's only chunk so far? (The last chunk answers for a call's streamed
            # chunks; the others are looked through only when calls interleave.)
            only = not tail or (tail[-1][5] != call_id and all(c[5] != call_id for c in tail))
            tail.append(chunk)
            self._latest_call = call_id
            self._cut_staging_known = only and call_id not in self._tail_constrained
            if self._cut_staging_known:
                self._cut_staging = staging_key
        elif kind in ("session.started", "session.state", "session.ended"):
            kept = None
            if kind == "session.state" and self.keep_payloads and start < len(record):
                kept = record[start:] if start else record
            if kind == "session.state" and data.get("checkpoint_id") is not None:
                self._export(data, kept, len(record) - start, offset)
                return
            if self.exports and data["session_id"] in self.exports:
                self._export_changed(data["session_id"])
            change = (kind, data, kept, len(record) - start, meta["participant"], offset)
            if self._pending_sessions is None:
                self._pending_sessions = [change]
            else:
                self._pending_sessions.append(change)
        elif kind == "episode.started":
            self._commit(offset)
            self._task(data, record, start)
            self.task_offset = offset
        elif kind == "episode.finished":
            self.finished = True
            self.finished_offset = offset
            self.reward = data.get("reward")
            if self.keep_payloads and start < len(record):
                self.result = Opaque(record[start:] if start else record)

    def _task(self, data: dict[str, Any], record: bytes, start: int) -> None:
        has_task = start < len(record)
        self.task_digest = data["task_digest"]
        self.deadline_s = data.get("deadline_s")
        self.task_bytes = len(record) - start
        if self.keep_payloads and has_task:
            self.task = Opaque(record[start:] if start else record)
        else:
            self.task = None
        lineage = self.lineage
        if lineage is not None:
            try:
                lineage.task(record[start:] if has_task else None, data.get("task_digest"))
            except Exception:  # the fold would fail on it too: leave this episode to a replay
                self.exact = False

    def _ledger_row(self, data: dict[str, Any], record: bytes, start: int) -> None:
        call_id = intern(data["call_id"])  # kept as a key of the lineage's rows
        token_ids_json = record[start:] if start < len(record) else b"[]"
        staging_key = data.get("staging_key")
        if staging_key:
            if self._pending_staging is None:
                self._pending_staging = [staging_key]
            else:
                self._pending_staging.append(staging_key)
        if data.get("constrained"):
            self._tail_constrained = self._tail_constrained | {call_id}
        self._latest_call = call_id
        self._cut_staging_known = False
        lineage = self.lineage
        if lineage is None:
            if self._pending_ledger is not None:
                self._pending_ledger.append(LedgerEntry.of_data(data, token_ids_json))
            return
        try:
            lineage.row(
                call_id,
                data.get("parent_call_id"),
                data["prev_len"],
                data["cum_len"],
                data["digest"],
                token_ids_json,
            )
        except Exception:  # the fold would fail on it too: leave this episode to a replay
            self.exact = False

    def _commit(self, offset: int) -> None:
        """A boundary (or ``episode.started``): everything pending joins the committed prefix."""
        if self._pending_sessions:
            self._commit_sessions()
        if self.exports:  # the change marks an export waited for are committed now
            self.exports = {
                sid: (c, False, changed) if waits and not changed else (c, waits, changed)
                for sid, (c, waits, changed) in self.exports.items()
            }
        pending = self._pending_staging
        if pending:
            for key in pending:
                if key not in self.staging_keys:
                    self.staging_keys.append(key)
            self._pending_staging = None
        lineage = self.lineage
        if lineage is not None:
            if lineage.pending:
                lineage.commit()
        elif self._pending_ledger and self.ledger is not None:
            self.ledger.extend(self._pending_ledger)
            self._pending_ledger.clear()
        pending_offsets = self._pending_ledger_offsets
        if pending_offsets:
            if self.ledger_offsets is None:
                self.ledger_offsets = pending_offsets
            else:
                self.ledger_offsets.extend(pending_offsets)
            self._pending_ledger_offsets = None
        if self._tail_chunks:
            self._tail_chunks.clear()
        self._tail_constrained = _NO_CALLS
        self._latest_call = None
        self._cut_staging = None
        self._cut_staging_known = True
        self.committed_through = offset

    def _drop_tail(self) -> None:
        """The tail's session changes and ledger rows are dropped (its chunks stay)."""
        self._pending_sessions = None
        if self._pending_ledger:
            self._pending_ledger.clear()
        self._pending_staging = None
        self._pending_ledger_offsets = None
        if self.lineage is not None:
            self.lineage.drop_tail()

    # -- reading the result ----------------------------------------------------------------

    def _cut_chunks(self) -> CutChunks | None:
        """The tail's generation cut (``_tail.cut_chunks``)."""
        return cut_chunks(self._latest_call, self._tail_constrained, self._tail_chunks)

    def generation_cut(self) -> GenerationCut | None:
        """The durable prefix of the tail's latest policy call (its token ids when kept)."""
        return generation_cut(self._cut_chunks())

    def referenced_staging_keys(self) -> tuple[str, ...]:
        """The committed rows' staging keys and the generation cut's (in order, no repeats)."""
        staging = self._staging
        if staging is None:
            key = None
            if self.finished:
                pass
            elif self._cut_staging_known:
                key = self._cut_staging
            else:
                found = self._cut_chunks()
                key = found[3][3][3] if found is not None else None
            if not key or key in self.staging_keys:
                staging = tuple(self.staging_keys)
            else:
                staging = (*self.staging_keys, key)
            self._staging = staging
        return staging

    def at_cut(self, *, waits: bool = True) -> CutDecision | None:
        """The capture rule: what a checkpoint's manifest says of this episode at a cut, or None
        when no attempt of it has begun (nothing to say).

        ``finished``; ``continue`` waiting for a boundary while a wait step is open (``waits``;
        once the awaited boundary came, the rule is asked again with ``waits=False``);
        ``restart`` while a ``restart_only`` session is open or when the attempt has recorded
        nothing yet; ``continue`` otherwise.
        """
        if self.first_offset is None and not self.attempt:
            return None
        if self.finished:
            return _FINISHED
        if waits and (self.open_waits or self.export_owners()):
            return _WAIT
        if self.restart_only_open:  # named: which sessions of whom (rare: built when it happens)
            return ("restart", restart_only_reason(self.sessions), False)
        if self.first_offset is None:
            return _NOTHING_YET
        return _CONTINUE

    def staging_keys_at_cut(self) -> tuple[str, ...]:
        """The staging keys a manifest entry of this state references: none once finished (the
        trainer has the episode's rows), else ``referenced_staging_keys``."""
        return () if self.finished else self.referenced_staging_keys()

    def payload_bytes(self) -> int:
        return (
            self.task_bytes + sum(self.boundary_bytes.values()) + sum(self.session_bytes.values())
        )

    def held_payload_bytes(self) -> int:
        """Of ``payload_bytes``, what a line composed from this state keeps on the heap: a state
        of ``SPLICE_BYTES`` or more is a piece of its own, which a prepare keeps mapped from a
        file (``ProjectionLine.held_bytes``)."""
        states = (*self.boundary_bytes.values(), *self.session_bytes.values())
        return self.task_bytes + sum(size for size in states if size < SPLICE_BYTES)

    def verdict(self) -> str | None:
        """What ``verify_projection`` says of this state's projection: why it cannot continue, or
        None. Meaningful while ``exact``."""
        if self._verdict is None:
            if self.lineage is None:
                self._verdict = (verify_projection(self.projection(0)),)
            else:
                found = None if self.finished else self._cut_chunks()
                if found is None:
                    self._verdict = (self.lineage.verdict(None, None, None),)
                else:
                    parent = found[3][3][0]
                    self._verdict = (self.lineage.verdict(found[0], found[4], parent),)
        return self._verdict[0]

    def projection(self, cut: int) -> EpisodeProjection:
        generation_cut = None if self.finished else self.generation_cut()
        return EpisodeProjection(
            episode=self.episode,
            attempt=self.attempt,
            status="finished" if self.finished else "live",
            cut=cut,
            first_offset=self.first_offset,
            task=self.task,
            task_digest=self.task_digest,
            deadline_s=self.deadline_s,
            boundaries=self._composed_boundaries()
            if self.boundary_deltas
            else dict(self.boundaries),
            sessions=dict(self.sessions),
            ledger=tuple(self.ledger or ()),
            generation_cut=generation_cut,
            open_waits=dict(self.open_waits),
            committed_through=self.committed_through,
            reward=self.reward,
            result=self.result,
            events_folded=self.events,
            payload_bytes=self.payload_bytes(),
            staging_keys=self.referenced_staging_keys(),
        )

    # -- pins: a reader keeps the state of one moment while records go on ------------------

    def pin(self) -> None:
        """Keep this state as it is now (copied on the next change) until ``unpin``."""
        self.pinned = True
        self._state_at_pin = None

    def pinned_state(self) -> EpisodeFold:
        """The state as it was at ``pin``."""
        return self._state_at_pin or self

    def unpin(self) -> EpisodeFold:
        """The state as it was at ``pin`` (this state itself if nothing changed since)."""
        state = self._state_at_pin or self
        self.pinned = False
        self._state_at_pin = None
        return state

    def _keep_pinned_state(self) -> None:
        self.pinned = False
        self._state_at_pin = self.snapshot()

    def snapshot(self) -> EpisodeFold:
        """A copy of this state that later records do not change (the filters are shared)."""
        return snapshot(self)

    # -- restores: a committed restore resets the state (``AttemptRules.begin_attempt``) ------

    def restart(self, attempt: int) -> None:
        """A restore started this episode over as ``attempt``: nothing carries on."""
        self.begin_attempt(attempt, "restart")

    def continue_at_cut(self, attempt: int) -> None:
        """A restore continues this episode as ``attempt`` from its state at the cut, which
        ``pin`` kept."""
        self.begin_attempt(attempt, self.unpin())

    def continue_from(self, projection: EpisodeProjection, attempt: int) -> None:
        """A restore continues this episode as ``attempt`` from ``projection`` (its cut)."""
        self.begin_attempt(attempt, projection)

    def fence_to(self, attempt: int) -> None:
        """A committed restore's ``attempt.started`` met without the restore's reset (while
        catching up): only the fence moves."""
        self.begin_attempt(attempt, "unknown")


#: The fields that make the state (what a restore takes back from a pinned copy): all but the
#: identity, the filters (which go on seeing records), the version and the pin bookkeeping.
EpisodeFold.STATE_FIELDS = tuple(
    name
    for name in (*SessionRules.__slots__, *AttemptRules.__slots__, *EpisodeFold.__slots__)
    if name not in ("episode", "filters", "version", "pinned", "_state_at_pin")
)
