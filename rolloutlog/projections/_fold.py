"""The fold: an episode's events up to its cut → its projection (docs/design.md §4, §5). No I/O.

The fold reads records the way the log keeps them: decoded metadata plus the raw bytes of the
payload field (``split_record``), so opaque states pass through undecoded and ledger digests are
checked on the raw token arrays. ``project_events`` accepts typed events for callers that have them.

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

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rolloutlog.log import Event, Opaque, encode_record, ledger_digest, split_record, token_count
from rolloutlog.projections._model import (
    BoundaryView,
    EpisodeProjection,
    GenerationCut,
    LedgerEntry,
    SessionView,
)

#: One record as the fold reads it: (offset, metadata, raw payload or None).
RecordView = tuple[int, dict[str, Any], bytes | None]

__all__ = [
    "EpisodeFold",
    "RecordView",
    "ledger_digest",
    "project_episode",
    "project_events",
    "project_raw",
    "select_records",
    "token_count",
]


@dataclass
class _Filters:
    """Per-episode state of the zombie, duplicate and attempt filters (rules 3-5)."""

    attempt: int = 0
    max_epoch: dict[str, int] = field(default_factory=dict)
    last_seq: dict[tuple[str, int], int] = field(default_factory=dict)

    def admits(self, meta: dict[str, Any]) -> bool:
        who = meta["participant"]
        pid, epoch = who["id"], who["epoch"]
        if self.max_epoch.get(pid, -1) > epoch:
            return False
        self.max_epoch[pid] = epoch
        key = (pid, epoch)
        seq = meta["seq"]
        last = self.last_seq.get(key)
        if last is not None and seq <= last:
            return False
        self.last_seq[key] = seq
        return bool(meta["attempt"] == self.attempt)


def select_records(
    records: Sequence[RecordView],
    cut: float,
    committed_restores: Container[int] | None = None,
    attempt: int = 0,
) -> tuple[list[RecordView], int]:
    """The records of one episode that the projection at ``cut`` folds, and the current attempt.

    The records may start after the episode's first event (a replay starts where the
    checkpoint's live episodes need it to): the attempt current at their start is the
    ``previous_attempt`` of the first committed ``attempt.started`` among them, or ``attempt``
    (the episode's attempt at the cut) when there is none.
    """
    kept: list[RecordView] = []
    filters = _Filters(attempt=_attempt_at_start(records, committed_restores, attempt))
    for record in records:
        offset, meta, _ = record
        if offset >= cut:
            break
        kind = meta["type"]
        if kind == "checkpoint.marker":
            continue
        if kind == "attempt.started":
            data = meta["data"]
            if committed_restores is not None and data["restore_id"] not in committed_restores:
                continue
            if meta["attempt"] <= filters.attempt:
                continue
            filters.attempt = meta["attempt"]
            restore_cut = data["cut"]
            kept = [r for r in kept if r[0] < restore_cut]
            if kept:
                # The fold drops the old attempt's uncommitted tail here (see EpisodeFold.apply).
                kept.append(record)
            continue
        if filters.admits(meta):
            kept.append(record)
    return kept, filters.attempt


def _attempt_at_start(
    records: Sequence[RecordView], committed_restores: Container[int] | None, attempt: int
) -> int:
    for _, meta, _ in records:
        if meta["type"] == "attempt.started" and (
            committed_restores is None or meta["data"]["restore_id"] in committed_restores
        ):
            return int(meta["data"]["previous_attempt"])
    return attempt


class EpisodeFold:
    """Applies already-selected records in order; ``projection()`` reads the result.

    Changes to sessions and the ledger wait in a pending list until the next boundary commits
    them, so the committed prefix and the tail come out of one pass. With
    ``keep_payloads=False`` it keeps sizes instead of states (what the projector needs).
    """

    def __init__(self, episode: str, attempt: int = 0, *, keep_payloads: bool = True) -> None:
        self.episode = episode
        self.attempt = attempt
        self.keep_payloads = keep_payloads
        self.first_offset: int | None = None
        self.task: Opaque | None = None
        self.task_digest: str | None = None
        self.deadline_s: float | None = None
        self.boundaries: dict[str, BoundaryView] = {}
        self.sessions: dict[str, SessionView] = {}
        self.ledger: list[LedgerEntry] = []
        self.open_waits: dict[str, int] = {}
        self.committed_through: int | None = None
        self.finished = False
        self.reward: float | None = None
        self.result: Opaque | None = None
        self.events = 0
        # The tail: changes not yet committed by a boundary.
        self._pending_sessions: list[tuple[str, dict[str, Any], bytes | None, dict[str, Any]]] = []
        self._pending_ledger: list[LedgerEntry] = []
        self._tail_chunks: dict[str, list[tuple[dict[str, Any], bytes | None]]] = {}
        self._tail_constrained: set[str] = set()
        self._latest_call: str | None = None

    # -- applying records ------------------------------------------------------------------

    def apply(self, offset: int, meta: dict[str, Any], payload: bytes | None) -> None:
        if meta["type"] == "attempt.started":
            # A restore continued the projection at its cut: the tail's session changes and
            # undelivered calls were dropped, so the next boundary must not commit them; the
            # generation cut stays until the new attempt commits past it.
            self._pending_sessions.clear()
            self._pending_ledger.clear()
            return
        if self.first_offset is None:
            self.first_offset = offset
        self.events += 1
        data = meta["data"]
        kind = meta["type"]
        if kind == "step.boundary":
            owner = data["owner"]
            self.open_waits.pop(owner, None)
            self._commit()
            self.boundaries[owner] = BoundaryView(
                stage=data["stage"],
                next=data.get("next"),
                state=self._keep(payload),
                step=meta.get("step"),
                offset=offset,
            )
            self.committed_through = offset
        elif kind == "step.started":
            if data.get("mode", "wait") == "wait":
                self.open_waits[data["owner"]] = offset
            else:
                self.open_waits.pop(data["owner"], None)
        elif kind == "ledger.row":
            self._pending_ledger.append(_ledger_entry(data, payload))
            if data.get("constrained"):
                self._tail_constrained.add(data["call_id"])
            self._latest_call = data["call_id"]
        elif kind == "generation.chunk":
            self._tail_chunks.setdefault(data["call_id"], []).append((data, payload))
            self._latest_call = data["call_id"]
        elif kind in ("session.started", "session.state", "session.ended"):
            self._pending_sessions.append((kind, data, payload, meta["participant"]))
        elif kind == "episode.started":
            self._commit()
            self.task = Opaque(payload) if payload is not None else None
            self.task_digest = data["task_digest"]
            self.deadline_s = data.get("deadline_s")
            self.committed_through = offset
        elif kind == "episode.finished":
            self.finished = True
            self.reward = data.get("reward")
            self.result = Opaque(payload) if payload is not None else None

    def _keep(self, payload: bytes | None) -> Opaque | None:
        if payload is None:
            return None
        return Opaque(payload) if self.keep_payloads else Opaque(b"null")

    def _commit(self) -> None:
        """A boundary: everything pending becomes part of the committed prefix."""
        for kind, data, payload, who in self._pending_sessions:
            sid = data["session_id"]
            if kind == "session.started":
                self.sessions[sid] = SessionView(
                    session_id=sid,
                    kind=who["kind"],
                    participant=who["id"],
                    mode=data.get("mode", "restart_only"),
                    verify=data.get("verify", "replay"),
                    state=None,
                )
            elif kind == "session.state":
                current = self.sessions.get(sid)
                state = self._keep(payload)
                if current is None:
                    # State of a session whose start was not recorded: it fails closed.
                    current = SessionView(
                        sid, who["kind"], who["id"], "restart_only", "replay", None
                    )
                self.sessions[sid] = SessionView(
                    current.session_id,
                    current.kind,
                    current.participant,
                    current.mode,
                    current.verify,
                    state,
                )
            else:
                self.sessions.pop(sid, None)
        self._pending_sessions.clear()
        self.ledger.extend(self._pending_ledger)
        self._pending_ledger.clear()
        self._tail_chunks.clear()
        self._tail_constrained.clear()
        self._latest_call = None

    # -- reading the result ----------------------------------------------------------------

    def generation_cut(self) -> GenerationCut | None:
        """The durable prefix of the tail's latest policy call (never for constrained calls)."""
        call = self._latest_call
        if call is None or call in self._tail_constrained:
            return None
        chunks = self._tail_chunks.get(call)
        if not chunks:
            return None
        by_start: dict[int, tuple[dict[str, Any], bytes | None]] = {}
        for data, payload in chunks:
            by_start.setdefault(data["start"], (data, payload))
        tokens: list[int] = []
        terminal = False
        problem = None if 0 in by_start else "chunks do not start at 0"
        last = next(iter(by_start.values()))[0]
        while len(tokens) in by_start and not terminal:
            data, payload = by_start[len(tokens)]
            piece: list[int] = orjson.loads(payload) if payload is not None else []
            if not piece and not data.get("done"):
                break
            tokens.extend(piece)
            terminal = bool(data.get("done"))
            last = data
        if problem is None and any(start > len(tokens) for start in by_start):
            problem = f"chunks are not contiguous after token {len(tokens)}"
        return GenerationCut(
            call_id=call,
            parent_call_id=last.get("parent_call_id"),
            request_digest=last["request_digest"],
            token_ids=tuple(tokens),
            terminal=terminal,
            policy_version=last["policy_version"],
            staging_key=last.get("staging_key"),
            problem=problem,
        )

    def projection(self, cut: int) -> EpisodeProjection:
        generation_cut = None if self.finished else self.generation_cut()
        staging = [row.staging_key for row in self.ledger if row.staging_key]
        if generation_cut is not None and generation_cut.staging_key:
            staging.append(generation_cut.staging_key)
        payload_bytes = len(self.task.raw) if self.task is not None else 0
        payload_bytes += sum(len(b.state.raw) for b in self.boundaries.values() if b.state)
        payload_bytes += sum(len(s.state.raw) for s in self.sessions.values() if s.state)
        return EpisodeProjection(
            episode=self.episode,
            attempt=self.attempt,
            status="finished" if self.finished else "live",
            cut=cut,
            first_offset=self.first_offset,
            task=self.task,
            task_digest=self.task_digest,
            deadline_s=self.deadline_s,
            boundaries=dict(self.boundaries),
            sessions=dict(self.sessions),
            ledger=tuple(self.ledger),
            generation_cut=generation_cut,
            open_waits=dict(self.open_waits),
            committed_through=self.committed_through,
            reward=self.reward,
            result=self.result,
            events_folded=self.events,
            payload_bytes=payload_bytes,
            staging_keys=tuple(dict.fromkeys(staging)),
        )


def _ledger_entry(data: dict[str, Any], payload: bytes | None) -> LedgerEntry:
    return LedgerEntry(
        call_id=data["call_id"],
        parent_call_id=data.get("parent_call_id"),
        fingerprint=data["fingerprint"],
        context_digest=data["context_digest"],
        policy_version=data["policy_version"],
        prev_len=data["prev_len"],
        cum_len=data["cum_len"],
        digest=data["digest"],
        staging_key=data.get("staging_key"),
        constrained=bool(data.get("constrained", False)),
        token_ids_json=payload if payload is not None else b"[]",
    )


def project_episode(
    episode: str,
    records: Iterable[RecordView],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    as_attempt: int | None = None,
    attempt: int = 0,
) -> EpisodeProjection:
    """The projection of ``episode`` at ``cut`` from its records in partition order.

    ``as_attempt`` labels it as the attempt that will continue it (a restore's new attempt);
    ``attempt`` is the episode's attempt at the cut, for records that start after the restore
    that made it current (a restarted episode's replay).
    """
    listed = records if isinstance(records, list) else list(records)
    if any(meta["type"] == "attempt.started" for _, meta, _ in listed):
        # Restores truncate what earlier attempts contributed: select first, then fold.
        kept, current = select_records(listed, cut, committed_restores, attempt)
        fold = EpisodeFold(episode, current if as_attempt is None else as_attempt)
        for offset, meta, payload in kept:
            fold.apply(offset, meta, payload)
        return fold.projection(cut)
    return _fold_in_one_pass(episode, listed, cut, as_attempt, attempt)


def _fold_in_one_pass(
    episode: str,
    records: Iterable[RecordView],
    cut: int,
    as_attempt: int | None,
    attempt: int = 0,
) -> EpisodeProjection:
    """The common case (no restore truncates anything): filter and fold as the records come."""
    fold = EpisodeFold(episode, attempt if as_attempt is None else as_attempt)
    admits = _Filters(attempt=attempt).admits
    apply = fold.apply
    for offset, meta, payload in records:
        if offset >= cut:
            break
        if admits(meta):
            apply(offset, meta, payload)
    return fold.projection(cut)


_ATTEMPT_STARTED = b'"type":"attempt.started"'


def project_raw(
    episode: str,
    records: list[tuple[int, bytes]],
    cut: int,
    committed_restores: Container[int] | None = None,
    *,
    as_attempt: int | None = None,
    attempt: int = 0,
) -> EpisodeProjection:
    """``project_episode`` over raw records: each record's metadata is decoded just before it is
    folded and dropped right after, so a replay of many episodes keeps few objects alive."""
    if any(_ATTEMPT_STARTED in record for _, record in records):
        return project_episode(
            episode,
            [(offset, *split_record(record)) for offset, record in records],
            cut,
            committed_restores,
            as_attempt=as_attempt,
            attempt=attempt,
        )
    views = ((offset, *split_record(record)) for offset, record in records)
    return _fold_in_one_pass(episode, views, cut, as_attempt, attempt)


def project_events(
    episode: str,
    events: Iterable[tuple[int, Event]],
    cut: int,
    committed_restores: Container[int] | None = None,
) -> EpisodeProjection:
    """``project_episode`` over typed events (as tests and golden streams hold them)."""
    records = ((offset, *split_record(encode_record(event))) for offset, event in events)
    return project_episode(episode, records, cut, committed_restores)
