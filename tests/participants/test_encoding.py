"""The SDK's own encodings agree with ``rolloutlog.log``'s for every event type it builds."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson

from rolloutlog.log import Position, decode_record, encode_record, split_record, validate_event
from rolloutlog.participants import Agent, Environment, Policy, Resources, Transport, fingerprint
from rolloutlog.participants._encoding import encode_record_fast, encode_wire
from rolloutlog.participants._transport import _Pending


class Capture(Transport):
    """Acknowledges at once and keeps every envelope."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    async def register(self, run: str, participant_id: str, kind: str) -> int:
        return 3

    def _encode(self, run: str, event: dict[str, Any]) -> bytes:
        self.events.append(event)
        return encode_wire(event)

    async def _send(self, run: str, items: Sequence[_Pending]) -> list[Position]:
        await asyncio.sleep(0)
        return [Position(0, i) for i, _ in enumerate(items)]


async def every_event_type() -> list[dict[str, Any]]:
    async with Capture() as transport:
        env = Environment(transport, "run", "env-0")
        resources = Resources(transport, "run", "res-0", mode="exported")
        agent = Agent(transport, "run", "agent-0")
        policy = Policy(transport, "run", "policy-0", chunk_tokens=2)
        for participant in (env, resources, agent, policy):
            await participant.register()
        episode = await env.start_episode("r1-a", {"b": 1, "a": [1.5, None]}, deadline_s=9.0)
        await episode.step_started("close_agent")
        await resources.open_session("r1-a-a2", "s1", state={"x": "é"})
        await resources.end_session("r1-a-a2", "s1")
        session = await agent.open_session("r1-a", "ag")
        await session.before_model_call({"turn": 0})
        generation = policy.generation("r1-a", "c1", request_digest="q")
        await generation.feed([1, 2, 3])
        await generation.complete()
        await policy.record_call(
            "r1-a", "c1", [1, 2, 3], fingerprint=fingerprint([1]), context_digest="c"
        )
        await episode.boundary("seed", None)
        await episode.finish(None)
        await episode.finish(0.5, {"r": True})
        return transport.events


async def test_unchecked_records_and_wire_envelopes_match_the_validated_ones() -> None:
    events = await every_event_type()
    types = {event["type"] for event in events}
    assert types == {
        "episode.started",
        "step.started",
        "step.boundary",
        "ledger.row",
        "generation.chunk",
        "session.started",
        "session.state",
        "session.ended",
        "episode.finished",
    }
    for event in events:
        checked = validate_event(event)
        fast = encode_record_fast(event)
        assert decode_record(fast) == checked
        meta, payload = split_record(fast)
        want_meta, want_payload = split_record(encode_record(checked))
        assert (meta, payload) == (want_meta, want_payload)
        assert validate_event(orjson.loads(encode_wire(event))) == checked
