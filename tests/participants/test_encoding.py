"""The SDK's own encodings agree with ``rolloutlog.log``'s for every event type it builds."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

import orjson

from rolloutlog.core import envelope_holds
from rolloutlog.errors import InvalidEvent
from rolloutlog.log import (
    Position,
    decode_record,
    encode_record,
    record_episode,
    split_record,
    validate_event,
)
from rolloutlog.participants import Agent, Environment, Policy, Resources, Transport, fingerprint
from rolloutlog.participants._encoding import check_built, encode_record_fast, encode_wire
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


async def test_the_sdk_envelopes_take_the_fast_path_and_start_with_their_episode() -> None:
    for event in await every_event_type():
        # else every event would pay for pydantic
        assert envelope_holds(event), event["type"]
        record = check_built(event)
        assert record == encode_record_fast(event)
        assert record.startswith(b'{"v":1,"episode":"')
        assert record_episode(record) == event["episode"]


#: Per field, values the cheap checks must treat as pydantic does (most are invalid).
ODD_VALUES: dict[str, list[Any]] = {
    "episode": ["r1-a3", "", "r 1", "r1\n", 7, "x" * 201],
    "attempt": [-1, True, 1.0, "1"],
    "step": [-1, True, 2.5],
    "seq": [-1, False],
    "ts": [True, "1", None, 3],
    "data.owner": ["", "a b", "seed\n", None, 1],
    "data.stage": ["not a stage name", "_x", "x" * 201, "y" * 200],
    "data.next": ["", "a/b"],
    "data.state": [{"plain": "dict"}, [1, 2], b"raw", None],
    "data.task": [{"t": 1}, None],
    "data.task_digest": ["", "d" * 129, 5],
    "data.deadline_s": [True, "9", 3],
    "data.mode": ["sometimes", None, "wait", "exported"],
    "data.verify": ["maybe", "replay"],
    "data.session_id": ["s 1", "", None],
    "data.call_id": ["c:1", "c 1"],
    "data.parent_call_id": ["", "p.1"],
    "data.fingerprint": ["", "f" * 128],
    "data.policy_version": [-1, True, 1.5],
    "data.prev_len": [-1],
    "data.cum_len": [99, -1],
    "data.token_ids": [[1, True], (1, 2, 3), ["1"], [1.0], []],
    "data.staging_key": [5, "k"],
    "data.constrained": [1, None],
    "data.start": [-1],
    "data.done": ["yes", 0],
    "data.reward": [True, "1", 2],
    "data.result": [{"r": 1}, "text"],
    "data.extra": [1],
}


def outcome(encode: Any, event: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "ok", split_record(encode(event))
    except InvalidEvent as e:
        return "invalid", e.details["field"]


async def test_the_cheap_checks_accept_and_refuse_what_pydantic_does() -> None:
    compared = 0
    for event in await every_event_type():
        for path, values in ODD_VALUES.items():
            where, _, name = path.rpartition(".")
            target = event["data"] if where == "data" else event
            if name not in target and name != "extra":
                continue
            for value in values:
                odd = copy.deepcopy(event)
                (odd["data"] if where == "data" else odd)[name] = value
                want = outcome(lambda e: encode_record(validate_event(e)), copy.deepcopy(odd))
                assert outcome(check_built, odd) == want, (event["type"], path, value)
                compared += 1
    assert compared > 300
