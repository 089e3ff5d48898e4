"""The policy model server: token-capture ledger rows, generation chunks, restored lineage, cuts."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter

from rolloutlog.log import Position, ledger_digest
from rolloutlog.participants._ledger import LedgerRowInfo, LedgerStore, MemoryLedger
from rolloutlog.participants._participant import Participant, RolloutContext, checked_name
from rolloutlog.participants._transport import Transport

__all__ = [
    "CONSTRAINED_FIELDS",
    "Generation",
    "GenerationPrefix",
    "LedgerRowInfo",
    "Policy",
    "constrained_request",
    "fingerprint",
    "ledger_digest",
]

_log = logging.getLogger("rolloutlog.participants.policy")

# In the participant's own process, in prometheus_client's default registry (serve it with
# ``prometheus_client.start_http_server`` or the app's own /metrics).
CHUNKS_SKIPPED = Counter(
    "rolloutlog_policy_chunks_skipped",
    "Generation chunks a policy did not write because the call used constrained decoding "
    "(such a call is never cut: a crash regenerates it)",
    ["participant"],
)
CUTS_REFUSED = Counter(
    "rolloutlog_policy_cuts_refused",
    "Restored generation cuts a policy refused to continue (the call regenerates), by reason",
    ["participant", "reason"],
)
PARENTS = Counter(
    "rolloutlog_policy_parents",
    "Parent resolutions by outcome: local (recorded by this worker), other_worker, restored, "
    "none, ambiguous, context_mismatch",
    ["participant", "outcome"],
)

#: Request fields that ask for constrained (guided / structured) decoding when set: OpenAI's
#: ``response_format`` (JSON object / schema) and a forcing ``tool_choice``, vLLM's ``guided_*``
#: and ``structured_outputs``, each also under ``extra_body``.
CONSTRAINED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def constrained_request(request: Mapping[str, Any]) -> bool:
    """Whether a chat/completions request asks for constrained decoding: ``tool_choice``
    ``required`` or a named tool, ``response_format`` other than ``text``, or any of
    ``CONSTRAINED_FIELDS`` set (also under ``extra_body``)."""
    extra = request.get("extra_body")
    if isinstance(extra, Mapping) and constrained_request(extra):
        return True
    choice = request.get("tool_choice")
    if choice == "required" or isinstance(choice, Mapping):
        return True
    response_format = request.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type", "text") != "text":
        return True
    return any(request.get(name) not in (None, "", {}, []) for name in CONSTRAINED_FIELDS)


def fingerprint(turns: Any) -> str:
    """sha256 of the canonical JSON of model-authored turns (the lineage key)."""
    return hashlib.sha256(orjson.dumps(turns, option=orjson.OPT_SORT_KEYS)).hexdigest()


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

    A continued call starts with the cut's prefix, so its chunks start at the prefix length, and
    it carries the oldest policy version that contributed tokens (``policy_version``: the cut's,
    when older than this server's). Constrained decoding is never chunked (each chunk it would
    have written is counted in ``Policy.chunks_skipped`` and the
    ``rolloutlog_policy_chunks_skipped_total`` metric).
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
        policy_version: int | None = None,
        done: bool = False,
    ) -> None:
        self.policy = policy
        self.context = context
        self.call_id = call_id
        self.parent_call_id = parent_call_id
        self.request_digest = request_digest
        self.constrained = constrained
        self.staging_key = staging_key
        self.policy_version = policy.policy_version if policy_version is None else policy_version
        self.token_ids: list[int] = list(prefix)
        self.durable = len(self.token_ids)
        #: the call's last chunk (``done``) is written, or it continues a terminal cut
        self.done = done
        self.chunks = 0
        self.skipped = 0

    def _chunk_data(self, end: int, done: bool) -> dict[str, Any]:
        piece = self.token_ids[self.durable : end]
        data = {
            "call_id": self.call_id,
            "parent_call_id": self.parent_call_id,
            "request_digest": self.request_digest,
            "start": self.durable,
            "token_ids": piece,
            "policy_version": self.policy_version,
            "staging_key": self.staging_key,
            "done": done,
        }
        return data

    def _written(self, end: int, done: bool) -> None:
        self.durable = end
        self.done = done
        self.chunks += 1

    async def _chunk(self, end: int, done: bool) -> None:
        await self.policy.emit("generation.chunk", self.context, self._chunk_data(end, done))
        self._written(end, done)

    async def feed(self, token_ids: Iterable[int]) -> None:
        """Add generated tokens; every ``chunk_tokens`` of them become durable in one chunk."""
        self.token_ids.extend(token_ids)
        size = self.policy.chunk_tokens
        while len(self.token_ids) - self.durable >= size:
            if self.constrained:
                self.policy._skipped(self)
                self.durable += size  # counted, never written
                continue
            await self._chunk(self.durable + size, False)

    async def complete(self) -> None:
        """The call finished generating: a long call's last chunk says ``done`` (a terminal cut
        if the response is never delivered). Short calls write nothing."""
        if self.constrained or self.done or (self.chunks == 0 and self.durable == 0):
            return
        await self._chunk(len(self.token_ids), True)

    async def deliver(self, token_ids: Sequence[int]) -> asyncio.Future[Position] | None:
        """The call is about to be delivered with these tokens (all of them, the durable prefix
        first): submits its last chunk (``done``) unless it has one, even for a call short
        enough, or not streamed, to have written none, so that a call delivered after its
        episode's last boundary leaves a terminal cut (a replacement serves it from its tokens
        instead of generating it again). Not awaited: submit the call's ledger row next (one
        append carries both), then await the returned future before delivering. None for a
        constrained call (never cut) or one whose last chunk is written."""
        if self.constrained or self.done:
            return None
        tokens = list(token_ids)
        if tokens[: self.durable] != self.token_ids[: self.durable]:
            raise ValueError(f"call {self.call_id}: the tokens delivered do not extend its chunks")
        self.token_ids = tokens
        submitted = await self.policy.emit_nowait(
            "generation.chunk", self.context, self._chunk_data(len(tokens), True)
        )
        self._written(len(tokens), True)
        return submitted


class Policy(Participant):
    """A policy model server: a ledger row per delivered call, written before delivery.

    ``ledger`` keeps the rows parents resolve against: this process's memory by default, or a
    ``SharedLedger`` that the worker processes of one policy server share, so a parent recorded
    by one worker resolves in another. Counters (also prometheus_client metrics, labelled with
    the participant id): ``chunks_skipped``, ``cuts_refused``, ``parents`` (by outcome).
    """

    kind = "policy"

    def __init__(
        self,
        transport: Transport,
        run: str,
        participant_id: str,
        *,
        policy_version: int = 0,
        chunk_tokens: int = 256,
        ledger: LedgerStore | None = None,
    ) -> None:
        super().__init__(transport, run, participant_id)
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.policy_version = policy_version
        self.chunk_tokens = chunk_tokens
        self.ledger: LedgerStore = ledger if ledger is not None else MemoryLedger()
        self.chunks_skipped = 0
        self.cuts_refused = 0
        #: parent resolutions by outcome (see ``resolve_parent``)
        self.parents: dict[str, int] = {}

    # -- lineage ---------------------------------------------------------------------------

    def resolve_parent(
        self,
        key: str | RolloutContext,
        fingerprint: str,
        *,
        context_digest: str | None = None,
    ) -> LedgerRowInfo | None:
        """The row whose fingerprint matches: exactly one, or None (never a guess).

        ``context_digest``: the digest of the context the parent was called with, as this
        request carries it (its messages before the parent's reply); a row recorded with another
        context is not this request's parent (None). Each outcome is counted in ``parents``:
        ``local`` (recorded by this worker), ``other_worker``, ``restored``, ``none``,
        ``ambiguous``, ``context_mismatch``.
        """
        capture_key = RolloutContext.of(key).capture_key
        found = self.ledger.matching(capture_key, fingerprint)
        row = found[0] if len(found) == 1 else None
        if row is None:
            outcome = "none" if not found else "ambiguous"
        elif context_digest is not None and row.context_digest != context_digest:
            outcome, row = "context_mismatch", None
        elif row.recorded_by is None:
            outcome = "restored"
        else:
            outcome = "local" if row.recorded_by == self.ledger.worker else "other_worker"
        self.parents[outcome] = self.parents.get(outcome, 0) + 1
        PARENTS.labels(self.id, outcome).inc()
        if outcome in ("ambiguous", "context_mismatch"):
            _log.warning(
                "%s: no parent for a call of %s (%s, %d rows with its fingerprint)",
                self.id,
                capture_key,
                outcome,
                len(found),
            )
        return row

    def install(self, projection: Mapping[str, Any]) -> int:
        """Restore a projection's ledger rows under its (new) capture key; returns the count."""
        key = str(projection["capture_key"])
        rows = [LedgerRowInfo.from_json(row) for row in projection.get("ledger", [])]
        return self.ledger.install(key, rows)

    # -- calls -----------------------------------------------------------------------------

    @staticmethod
    def is_constrained(request: Mapping[str, Any] | None, constrained: bool | None) -> bool:
        """The caller's flag when given (it overrides), else classified from the request
        (``constrained_request``); False with neither."""
        if constrained is not None:
            return constrained
        return request is not None and constrained_request(request)

    def generation(
        self,
        key: str | RolloutContext,
        call_id: str,
        *,
        parent_call_id: str | None = None,
        request_digest: str,
        request: Mapping[str, Any] | None = None,
        constrained: bool | None = None,
        staging_key: str | None = None,
        cut: GenerationPrefix | None = None,
    ) -> Generation:
        """Track an in-flight call; ``cut`` continues a validated prefix under its call id.

        Constrained decoding (never cut) is read from ``request`` (``constrained_request``)
        unless ``constrained`` says otherwise.
        """
        context = RolloutContext.of(key)
        version = None
        if cut is not None:
            if cut.call_id != call_id:
                raise ValueError(f"a cut of call {cut.call_id!r} continues under that call id")
            parent_call_id = cut.parent_call_id
            version = min(cut.policy_version, self.policy_version)
        return Generation(
            self,
            RolloutContext(context.episode, context.attempt),
            checked_name("call id", call_id),
            parent_call_id,
            request_digest,
            self.is_constrained(request, constrained),
            staging_key,
            cut.token_ids if cut is not None else (),
            version,
            done=cut is not None and cut.terminal,
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
        request: Mapping[str, Any] | None = None,
        constrained: bool | None = None,
        policy_version: int | None = None,
    ) -> LedgerRowInfo:
        """``ledger.row`` of a call about to be delivered; await it before delivering.

        ``token_ids`` are the call's new tokens; the parent (resolve it with
        ``resolve_parent``) gives ``prev_len`` and the digest chain. ``policy_version``: the
        oldest version that contributed tokens (a continued call's ``Generation.policy_version``),
        never newer than this server's; this server's by default.
        """
        context = RolloutContext.of(key)
        if parent_call_id is None:
            parent_digest, prev_len = "", 0
        else:
            parent = self.ledger.get(context.capture_key, parent_call_id)
            if parent is None:
                raise ValueError(f"parent call {parent_call_id!r} is not in this episode's ledger")
            parent_digest, prev_len = parent.digest, parent.cum_len
        version = self.policy_version
        if policy_version is not None:
            version = min(policy_version, version)
        tokens = list(token_ids)
        row = LedgerRowInfo(
            call_id=checked_name("call id", call_id),
            parent_call_id=parent_call_id,
            fingerprint=fingerprint,
            context_digest=context_digest,
            policy_version=version,
            prev_len=prev_len,
            cum_len=prev_len + len(tokens),
            digest=ledger_digest(parent_digest, tokens),
            staging_key=staging_key,
            constrained=self.is_constrained(request, constrained),
            recorded_by=self.ledger.worker,
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
        # after the row is durable, before the reply leaves: a child call (on any worker)
        # needs the reply, so it always finds its parent here
        self.ledger.put(context.capture_key, row)
        return row

    # -- cuts ------------------------------------------------------------------------------

    def _skipped(self, generation: Generation) -> None:
        self.chunks_skipped += 1
        CHUNKS_SKIPPED.labels(self.id).inc()
        if generation.skipped == 0:
            _log.info(
                "%s: call %s of %s uses constrained decoding: its chunks are not written "
                "(never cut, regenerated after a crash)",
                self.id,
                generation.call_id,
                generation.context.capture_key,
            )
        generation.skipped += 1

    def claim_cut(self, capture_key: str) -> bool:
        """True for the one call (on any worker) that may continue the restored cut of
        ``capture_key``: the attempt's first call to reach the policy."""
        return self.ledger.claim(f"cut:{capture_key}")

    def refuse_cut(self, call_id: str, capture_key: str | None, reason: str) -> None:
        """Count (``cuts_refused``, the metric by ``reason``) and log a restored cut that will
        not be continued: the call regenerates. ``validate_cut`` calls it; so does a server
        whose backend cannot continue a cut that validated."""
        self.cuts_refused += 1
        CUTS_REFUSED.labels(self.id, reason).inc()
        _log.warning(
            "%s: refused the generation cut of call %s for %s (%s): the call regenerates",
            self.id,
            call_id,
            capture_key,
            reason,
        )

    def validate_cut(
        self,
        projection: Mapping[str, Any],
        *,
        request_digest: str,
    ) -> GenerationPrefix | None:
        """The projection's generation cut, if a replacement call may continue it: its source call
        was not delivered (no ledger row), its parent is in the ledger, it was made for this
        request (``request_digest``), it holds tokens, and its policy version is not newer than
        this server's. Otherwise None (the call regenerates; ``cuts_refused`` and the
        ``rolloutlog_policy_cuts_refused_total{reason}`` metric count it, and it is logged)."""
        cut = projection.get("generation_cut")
        if cut is None:
            return None
        ledger = {row["call_id"] for row in projection.get("ledger", [])}
        tokens = tuple(int(t) for t in cut.get("token_ids", ()))
        reason = None
        if cut["call_id"] in ledger:
            reason = "delivered"
        elif cut.get("parent_call_id") is not None and cut["parent_call_id"] not in ledger:
            reason = "parent_missing"
        elif cut.get("request_digest") != request_digest:
            reason = "request_mismatch"
        elif not (tokens or cut.get("terminal")):
            reason = "empty"
        elif int(cut.get("policy_version", 0)) > self.policy_version:
            reason = "policy_newer"
        if reason is not None:
            self.refuse_cut(cut["call_id"], projection.get("capture_key"), reason)
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
