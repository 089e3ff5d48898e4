"""The policy model server: token-capture ledger rows, generation chunks, restored lineage, cuts."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from rolloutlog.log import ledger_digest
from rolloutlog.participants._participant import Participant, RolloutContext, check_name
from rolloutlog.participants._transport import Transport

__all__ = [
    "Generation",
    "GenerationPrefix",
    "LedgerRowInfo",
    "Policy",
    "fingerprint",
    "ledger_digest",
]


def fingerprint(turns: Any) -> str:
    """sha256 of the canonical JSON of model-authored turns (the lineage key)."""
    return hashlib.sha256(orjson.dumps(turns, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True, slots=True)
class LedgerRowInfo:
    """A ledger row as the policy keeps it (recorded here, or restored from a projection)."""

    call_id: str
    parent_call_id: str | None
    fingerprint: str
    context_digest: str
    policy_version: int
    prev_len: int
    cum_len: int
    digest: str
    staging_key: str | None
    constrained: bool

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> LedgerRowInfo:
        return cls(
            call_id=row["call_id"],
            parent_call_id=row.get("parent_call_id"),
            fingerprint=row["fingerprint"],
            context_digest=row["context_digest"],
            policy_version=int(row["policy_version"]),
            prev_len=int(row["prev_len"]),
            cum_len=int(row["cum_len"]),
            digest=row["digest"],
            staging_key=row.get("staging_key"),
            constrained=bool(row.get("constrained", False)),
        )


@dataclass(frozen=True, slots=True)
class GenerationPrefix:
    """A validated durable prefix a replacement call continues (same ``call_id``)."""

    call_id: str
    parent_call_id: str | None
    request_digest: str
    token_ids: tuple[int, ...]
    terminal: bool
    policy_version: int
    staging_key: str | None


class Generation:
    """One in-flight call's output: a ``generation.chunk`` every ``chunk_tokens`` tokens.

    A continued call starts with the cut's prefix, so its chunks start at the prefix length.
    Constrained decoding is never chunked (each chunk it would have written is counted in
    ``Policy.chunks_skipped``).
    """

    def __init__(
        self,
        policy: Policy,
        context: RolloutContext,
        call_id: str,
        parent_call_id: str | None,
        request_digest: str,
        constrained: bool,
        staging_key: str | None,
        prefix: Sequence[int] = (),
    ) -> None:
        self.policy = policy
        self.context = context
        self.call_id = call_id
        self.parent_call_id = parent_call_id
        self.request_digest = request_digest
        self.constrained = constrained
        self.staging_key = staging_key
        self.token_ids: list[int] = list(prefix)
        self.durable = len(self.token_ids)
        self.chunks = 0

    async def _chunk(self, end: int, done: bool) -> None:
        piece = self.token_ids[self.durable : end]
        data = {
            "call_id": self.call_id,
            "parent_call_id": self.parent_call_id,
            "request_digest": self.request_digest,
            "start": self.durable,
            "token_ids": piece,
            "policy_version": self.policy.policy_version,
            "staging_key": self.staging_key,
            "done": done,
        }
        await self.policy.emit("generation.chunk", self.context, data)
        self.durable = end
        self.chunks += 1

    async def feed(self, token_ids: Iterable[int]) -> None:
        """Add generated tokens; every ``chunk_tokens`` of them become durable in one chunk."""
        self.token_ids.extend(token_ids)
        size = self.policy.chunk_tokens
        while len(self.token_ids) - self.durable >= size:
            if self.constrained:
                self.policy.chunks_skipped += 1
                self.durable += size  # counted, never written
                continue
            await self._chunk(self.durable + size, False)

    async def complete(self) -> None:
        """The call finished generating: a long call's last chunk says ``done`` (a terminal cut
        if the response is never delivered). Short calls write nothing."""
        if self.constrained or (self.chunks == 0 and self.durable == 0):
            return
        await self._chunk(len(self.token_ids), True)


class Policy(Participant):
    """A policy model server: a ledger row per delivered call, written before delivery."""

    kind = "policy"

    def __init__(
        self,
        transport: Transport,
        run: str,
        participant_id: str,
        *,
        policy_version: int = 0,
        chunk_tokens: int = 256,
    ) -> None:
        super().__init__(transport, run, participant_id)
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.policy_version = policy_version
        self.chunk_tokens = chunk_tokens
        self.chunks_skipped = 0
        self.cuts_refused = 0
        #: capture key -> call id -> row (restored rows live under the new capture key).
        self.ledgers: dict[str, dict[str, LedgerRowInfo]] = {}

    # -- lineage ---------------------------------------------------------------------------

    def resolve_parent(self, key: str | RolloutContext, fingerprint: str) -> LedgerRowInfo | None:
        """The row whose fingerprint matches: exactly one, or None (never a guess)."""
        rows = self.ledgers.get(RolloutContext.of(key).capture_key, {})
        found = [row for row in rows.values() if row.fingerprint == fingerprint]
        return found[0] if len(found) == 1 else None

    def install(self, projection: Mapping[str, Any]) -> int:
        """Restore a projection's ledger rows under its (new) capture key; returns the count."""
        key = str(projection["capture_key"])
        rows = {
            row["call_id"]: LedgerRowInfo.from_json(row) for row in projection.get("ledger", [])
        }
        self.ledgers[key] = rows
        return len(rows)

    # -- calls -----------------------------------------------------------------------------

    def generation(
        self,
        key: str | RolloutContext,
        call_id: str,
        *,
        parent_call_id: str | None = None,
        request_digest: str,
        constrained: bool = False,
        staging_key: str | None = None,
        cut: GenerationPrefix | None = None,
    ) -> Generation:
        """Track an in-flight call; ``cut`` continues a validated prefix under its call id."""
        context = RolloutContext.of(key)
        if cut is not None:
            if cut.call_id != call_id:
                raise ValueError(f"a cut of call {cut.call_id!r} continues under that call id")
            parent_call_id = cut.parent_call_id
        return Generation(
            self,
            RolloutContext(context.episode, context.attempt),
            check_name("call id", call_id),
            parent_call_id,
            request_digest,
            constrained,
            staging_key,
            cut.token_ids if cut is not None else (),
        )

    async def record_call(
        self,
        key: str | RolloutContext,
        call_id: str,
        token_ids: Sequence[int],
        *,
        fingerprint: str,
        context_digest: str,
        parent_call_id: str | None = None,
        staging_key: str | None = None,
        constrained: bool = False,
    ) -> LedgerRowInfo:
        """``ledger.row`` of a call about to be delivered; await it before delivering.

        ``token_ids`` are the call's new tokens; the parent (resolve it with
        ``resolve_parent``) gives ``prev_len`` and the digest chain.
        """
        context = RolloutContext.of(key)
        rows = self.ledgers.setdefault(context.capture_key, {})
        if parent_call_id is None:
            parent_digest, prev_len = "", 0
        else:
            parent = rows.get(parent_call_id)
            if parent is None:
                raise ValueError(f"parent call {parent_call_id!r} is not in this episode's ledger")
            parent_digest, prev_len = parent.digest, parent.cum_len
        tokens = list(token_ids)
        row = LedgerRowInfo(
            call_id=check_name("call id", call_id),
            parent_call_id=parent_call_id,
            fingerprint=fingerprint,
            context_digest=context_digest,
            policy_version=self.policy_version,
            prev_len=prev_len,
            cum_len=prev_len + len(tokens),
            digest=ledger_digest(parent_digest, tokens),
            staging_key=staging_key,
            constrained=constrained,
        )
        data = {
            "call_id": row.call_id,
            "parent_call_id": row.parent_call_id,
            "fingerprint": row.fingerprint,
            "context_digest": row.context_digest,
            "policy_version": row.policy_version,
            "prev_len": row.prev_len,
            "token_ids": tokens,
            "cum_len": row.cum_len,
            "digest": row.digest,
            "staging_key": row.staging_key,
            "constrained": row.constrained,
        }
        await self.emit("ledger.row", RolloutContext(context.episode, context.attempt), data)
        rows[row.call_id] = row
        return row

    # -- cuts ------------------------------------------------------------------------------

    def validate_cut(
        self,
        projection: Mapping[str, Any],
        *,
        request_digest: str,
    ) -> GenerationPrefix | None:
        """The projection's generation cut, if a replacement call may continue it: its source call
        was not delivered (no ledger row), its parent is in the ledger, it was made for this
        request (``request_digest``), it holds tokens, and its policy version is not newer than
        this server's. Otherwise None (the call regenerates; ``cuts_refused`` counts it)."""
        cut = projection.get("generation_cut")
        if cut is None:
            return None
        ledger = {row["call_id"] for row in projection.get("ledger", [])}
        tokens = tuple(int(t) for t in cut.get("token_ids", ()))
        ok = (
            cut["call_id"] not in ledger
            and (cut.get("parent_call_id") is None or cut["parent_call_id"] in ledger)
            and cut.get("request_digest") == request_digest
            and (tokens or cut.get("terminal"))
            and int(cut.get("policy_version", 0)) <= self.policy_version
        )
        if not ok:
            self.cuts_refused += 1
            return None
        return GenerationPrefix(
            call_id=cut["call_id"],
            parent_call_id=cut.get("parent_call_id"),
            request_digest=cut["request_digest"],
            token_ids=tokens,
            terminal=bool(cut.get("terminal")),
            policy_version=int(cut["policy_version"]),
            staging_key=cut.get("staging_key"),
        )
