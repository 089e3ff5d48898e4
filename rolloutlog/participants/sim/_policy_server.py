"""The fake policy model server: deterministic tokens at a configurable rate, recorded as the SDK's
policy kind records them (generation chunks for long calls, a ledger row before delivery)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from rolloutlog.participants._ledger import LedgerStore, MemoryLedger, SharedLedger
from rolloutlog.participants._participant import RolloutContext
from rolloutlog.participants._policy import GenerationPrefix, Policy, fingerprint
from rolloutlog.participants._transport import Transport
from rolloutlog.participants.sim._model import (
    context_digest,
    reply_text,
    request_digest,
    sim_tokens,
)
from rolloutlog.participants.sim._runtime import ServerSettings, SimServer, request_context

__all__ = ["policy_server"]


def policy_server(settings: ServerSettings) -> SimServer:
    """``POST /generate`` ``{"turns": [...], "call_index", "tokens", "token_rate"?}`` plus any
    constrained-decoding fields (``response_format``, ``tool_choice``, ``guided_*``; a
    ``constrained`` flag overrides them) under a rollout context → ``{"call_id",
    "parent_call_id", "token_ids", "text"}``.

    With ``--workers N`` each worker process runs this app as participant ``<id>.w<i>`` and the
    workers share their ledger rows (``SharedLedger``): a parent resolves whichever worker
    recorded it, and a restored cut is continued by one call only (``Policy.claim_cut``).

    A replacement attempt's calls resolve their parent by fingerprint among the rows restored
    under its capture key (bulk ``Restores.install`` at start when the process is given a
    restore id, else one ``fetch`` per episode on its first call); its first call continues the
    restore's generation cut when the cut validates for that request.

    Hold points: ``mid_generation`` (once ``after_tokens`` tokens are durable in chunks),
    ``before_record`` (generated, no ledger row yet), ``before_deliver`` (row durable, reply not
    sent). ``/sim/stats``: every call served (``capture_key``, ``call_id``, ``parent_call_id``,
    ``call_index``, ``generated``, ``continued``, ``constrained``, ``chunks``, ``delivered``,
    ``worker``, ``parent_worker``: who recorded the parent, None when restored, ``t``), the rows
    installed per capture key, ``chunks_skipped``, ``cuts_refused``, ``parents`` (resolutions
    by outcome, ``other_worker`` among them), ``worker``.
    """
    worker = settings.worker_name
    ledger: LedgerStore = MemoryLedger(worker)
    participant_id = settings.participant_id
    if settings.worker_index is not None:
        # one participant per worker: a shared id would fence the sibling that registered first
        participant_id = f"{participant_id}.{worker}"
        if settings.ledger_path is not None:
            ledger = SharedLedger(settings.ledger_path, worker)

    def policy_in(transport: Transport, run: str) -> Policy:
        # Another run (a fork beside this one) gets a ledger of its own, and the fork's
        # policy version: capture keys repeat across runs, rows must not.
        own = run == settings.run
        version = settings.policy_version
        if not own and settings.fork_policy_version is not None:
            version = settings.fork_policy_version
        return Policy(
            transport,
            run,
            participant_id,
            policy_version=version,
            chunk_tokens=settings.chunk_tokens,
            ledger=ledger if own else MemoryLedger(worker),
        )

    server = SimServer(settings, policy_in)
    calls: list[dict[str, Any]] = []
    #: per (run, capture key): rows installed; its restored projection until its first call
    #: consumed the cut; whether it was fetched
    installed: dict[tuple[str, str], int] = {}
    cuts: dict[tuple[str, str], dict[str, Any]] = {}
    fetched: set[tuple[str, str]] = set()
    locks: dict[tuple[str, str], asyncio.Lock] = {}

    def keep(run: str, policy: Policy, projection: dict[str, Any]) -> None:
        key = (run, str(projection["capture_key"]))
        installed[key] = policy.install(projection)
        fetched.add(key)
        if projection.get("generation_cut") is not None:
            cuts[key] = projection

    async def bulk_install() -> None:
        if settings.restore_id is None:
            return
        own = server.participant
        assert isinstance(own, Policy)
        async for projection in server.restores.install(
            settings.run, settings.restore_id, kind="policy"
        ):
            keep(settings.run, own, projection)

    server.on_start.append(bulk_install)

    async def ensure_restored(
        run: str, policy: Policy, context: RolloutContext, restore_id: int | None
    ) -> None:
        key = (run, context.capture_key)
        if context.attempt == 0 or key in fetched or restore_id is None:
            return
        lock = locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in fetched:
                return
            projection = await server.projection(context.episode, restore_id, run)
            if projection is not None and projection.get("capture_key") == context.capture_key:
                keep(run, policy, projection)
            fetched.add(key)

    def stats() -> dict[str, Any]:
        policies = [p for p in server.runs.values() if isinstance(p, Policy)]
        parents: dict[str, int] = {}
        for p in policies:
            for outcome, count in p.parents.items():
                parents[outcome] = parents.get(outcome, 0) + count
        return {
            "worker": worker,
            "calls": calls,
            # this run's capture keys as before; another run's as "run/capture key"
            "installed": {
                (k if r == settings.run else f"{r}/{k}"): n for (r, k), n in installed.items()
            },
            "chunks_skipped": sum(p.chunks_skipped for p in policies),
            "cuts_refused": sum(p.cuts_refused for p in policies),
            "parents": parents,
        }

    server.stats = stats
    app = server.app

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        context = request_context(request)
        key = context.capture_key
        run = server.run_of(request)
        policy = await server.participant_in(run)
        assert isinstance(policy, Policy)
        turns: list[str] = list(body.get("turns", []))
        call_index = int(body.get("call_index", len(turns)))
        count = int(body["tokens"])
        flag = body.get("constrained")
        constrained = policy.is_constrained(body, None if flag is None else bool(flag))
        rate = float(body.get("token_rate") or settings.token_rate)
        digest = request_digest(context.episode, call_index, count, constrained)
        await ensure_restored(run, policy, context, server.restore_id(request, body))
        parent = None
        if turns:
            # the parent was called with every turn before its own reply (the last one)
            parent = policy.resolve_parent(
                key, fingerprint(turns), context_digest=context_digest(turns[:-1])
            )
        parent_id = parent.call_id if parent is not None else None
        cut: GenerationPrefix | None = None
        projection = cuts.pop((run, key), None)
        if projection is not None and policy.claim_cut(key):
            cut = policy.validate_cut(projection, request_digest=digest)
        call_id = cut.call_id if cut is not None else f"{key}.c{call_index}"
        generation = policy.generation(
            context,
            call_id,
            parent_call_id=parent_id,
            request_digest=digest,
            constrained=constrained,
            cut=cut,
        )
        expected = sim_tokens(context.episode, call_index, count)
        continued = len(generation.token_ids)
        record: dict[str, Any] = {
            "t": time.time(),
            "worker": worker,
            "parent_worker": None if parent is None else parent.recorded_by,
            "run": run,
            "policy_version": policy.policy_version,
            "capture_key": key,
            "call_id": call_id,
            "parent_call_id": generation.parent_call_id,
            "call_index": call_index,
            "constrained": constrained,
            "continued": continued,
            "generated": 0,
            "prefix_ok": generation.token_ids == expected[:continued],
            "terminal_cut": bool(cut is not None and cut.terminal),
            "chunks": 0,
            "delivered": False,
        }
        calls.append(record)
        step = max(1, min(settings.chunk_tokens, int(rate / 100) or 1))
        position = continued if not (cut is not None and cut.terminal) else count
        while position < count:
            end = min(count, position + step)
            # steps never straddle a chunk boundary, so a hold after K tokens sees K durable
            boundary = (position // settings.chunk_tokens + 1) * settings.chunk_tokens
            end = min(end, boundary)
            await asyncio.sleep((end - position) / rate)
            await generation.feed(expected[position:end])
            record["generated"] += end - position
            position = end
            await server.holds.park(
                "mid_generation", key, tokens=generation.durable, call_id=call_id
            )
        await generation.complete()
        record["chunks"] = generation.chunks
        await server.holds.park("before_record", key, call_id=call_id)
        text = reply_text(call_index, generation.token_ids)
        row = await policy.record_call(
            context,
            call_id,
            generation.token_ids,
            fingerprint=fingerprint([*turns, text]),
            context_digest=context_digest(turns),
            parent_call_id=generation.parent_call_id,
            constrained=constrained,
            policy_version=generation.policy_version,
        )
        await server.holds.park("before_deliver", key, call_id=call_id)
        record["delivered"] = True
        return {
            "call_id": row.call_id,
            "parent_call_id": row.parent_call_id,
            "token_ids": generation.token_ids,
            "text": text,
        }

    return server
