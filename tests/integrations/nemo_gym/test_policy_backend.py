"""The policy server's backend calls (``_backend.CallClient``) against the fake OpenAI-compatible
backend in process: a streamed call leaves generation chunks and answers as the plain call does,
a restored cut is continued with no token generated twice (and the prefix's log probabilities
recovered), a cut that cannot be continued regenerates, constrained decoding is never streamed.
No NeMo Gym needed: this is the part of the policy that talks to the backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.integrations.nemo_gym._backend import CallClient, CallState
from rolloutlog.integrations.nemo_gym._fake_model import decode, encode, turn_of
from rolloutlog.integrations.nemo_gym._parsers import ToolParser, hermes
from rolloutlog.integrations.nemo_gym.fake_backend import (
    CallLog,
    FakeBackend,
    backend_app,
    read_call_log,
    read_scores,
)
from rolloutlog.participants import GenerationPrefix, Policy
from tests.participants.test_encoding import Capture

SCRIPT = [{"call": "increment_counter", "arguments": {"count": 1}}, {"say": "done"}]


def request(filler: int = 40, **extra: Any) -> dict[str, Any]:
    """A Chat Completion request as vllm_model sends it with return_token_id_information."""
    metadata = {"fake_script": orjson.dumps(SCRIPT).decode(), "fake_tokens": str(filler)}
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "[p1] add 1"}],
        "metadata": metadata,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        **extra,
    }


class Inner:
    """vllm_model's client, as much of it as the call client uses."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.base_url = "http://backend/v1"
        self.api_key = "fake"
        self.default_headers: dict[str, str] = {}

    async def create_chat_completion(self, **body: Any) -> Any:
        response = await self.http.post(f"{self.base_url}/chat/completions", json=body)
        response.raise_for_status()
        return response.json()


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    log = tmp_path / "calls.jsonl"
    app = backend_app(FakeBackend(CallLog(log), token_rate=1e6))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://backend") as http:
        yield http, log


async def one_call(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    *,
    stream: bool,
    cut: GenerationPrefix | None,
    parser: ToolParser | None = None,
) -> tuple[Any, CallState, list[dict[str, Any]]]:
    """One call through a CallClient; returns the reply, the call and the envelopes written."""
    async with Capture() as transport:
        policy = Policy(transport, "run", "policy-0", chunk_tokens=8)
        await policy.register()
        call_id = cut.call_id if cut is not None else "p1.c0"
        generation = policy.generation(
            "p1", call_id, request_digest="d", parent_call_id=None, cut=cut
        )
        call = CallState(policy, generation, cut, "p1.c0", stream, ["<tool_call>"], parser)
        reply = await CallClient(Inner(http), call, http).create_chat_completion(**body)
        return reply, call, transport.events


async def test_a_streamed_call_leaves_chunks_and_answers_as_a_plain_one(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, log = backend
    plain, plain_call, plain_events = await one_call(http, request(), stream=False, cut=None)
    streamed, call, events = await one_call(http, request(), stream=True, cut=None)
    assert plain_events == []  # a call that is not streamed is never cut
    assert streamed["choices"][0]["message"] == plain["choices"][0]["message"]
    assert streamed["choices"][0]["logprobs"] == {
        "content": [
            {k: e[k] for k in ("token", "logprob")} | {"bytes": e["bytes"], "top_logprobs": []}
            for e in plain["choices"][0]["logprobs"]["content"]
        ]
    }
    assert streamed["usage"] == plain["usage"]
    assert call.token_ids == plain_call.token_ids == encode(turn_of(request())[0].text)
    chunks = [e["data"] for e in events if e["type"] == "generation.chunk"]
    assert [c["start"] for c in chunks] == list(range(0, len(call.token_ids), 8))
    assert [t for c in chunks for t in c["token_ids"]] == call.token_ids
    assert chunks[-1]["done"] is True
    assert [(c["stream"], c["generated"]) for c in read_call_log(log)] == [
        (False, len(call.token_ids)),
        (True, len(call.token_ids)),
    ]


async def test_a_restored_cut_is_continued_with_no_token_generated_twice(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, log = backend
    whole, whole_call, _ = await one_call(http, request(), stream=False, cut=None)
    prefix = tuple(whole_call.token_ids[:24])  # filler only: safe to continue
    assert "<" not in decode(prefix)
    cut = GenerationPrefix("p1.c0", None, "d", prefix, False, 0, None)
    for stream in (False, True):
        reply, call, events = await one_call(http, request(), stream=stream, cut=cut)
        assert call.continued == 24 and call.token_ids == whole_call.token_ids
        # the prefix's log probabilities come back from the backend as prompt log probabilities
        assert reply["choices"][0] == {
            **whole["choices"][0],
            "logprobs": reply["choices"][0]["logprobs"],
        }
        got = [(e["token"], e["logprob"]) for e in reply["choices"][0]["logprobs"]["content"]]
        want = [(e["token"], e["logprob"]) for e in whole["choices"][0]["logprobs"]["content"]]
        assert got == want
        assert reply["usage"] == whole["usage"]
        chunks = [e["data"] for e in events if e["type"] == "generation.chunk"]
        assert all(c["call_id"] == "p1.c0" and c["start"] >= 24 for c in chunks)
        assert bool(chunks) == stream
    continued = [(c["continued"], c["generated"]) for c in read_call_log(log)[1:]]
    rest = len(whole_call.token_ids) - 24
    assert continued == [(24, rest), (24, rest)]


async def test_a_cut_inside_tool_call_markup_regenerates(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, log = backend
    _, whole_call, _ = await one_call(http, request(filler=8), stream=False, cut=None)
    prefix = tuple(whole_call.token_ids[:12])  # 8 filler characters, then "<too"
    cut = GenerationPrefix("p1.c0-old", None, "d", prefix, False, 0, None)
    reply, call, _ = await one_call(http, request(filler=8), stream=True, cut=cut)
    assert call.policy.cuts_refused == 1
    assert call.cut is None and call.continued == 0
    assert call.generation.call_id == "p1.c0"  # the fresh id, not the cut's
    assert call.token_ids == whole_call.token_ids
    assert (
        reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "increment_counter"
    )
    assert [c["continued"] for c in read_call_log(log)] == [0, 0]  # nothing was continued


TOOLS = [{"type": "function", "function": {"name": "increment_counter", "parameters": {}}}]


async def test_a_terminal_cut_is_served_from_its_tokens_with_no_token_generated(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, log = backend
    body = request(tools=TOOLS)
    whole, whole_call, _ = await one_call(http, body, stream=False, cut=None)
    cut = GenerationPrefix("p1.c0", None, "d", tuple(whole_call.token_ids), True, 0, None)
    reply, call, events = await one_call(http, body, stream=True, cut=cut, parser=hermes)
    assert call.served and call.token_ids == whole_call.token_ids and events == []
    got, want = reply["choices"][0], whole["choices"][0]
    assert got["finish_reason"] == want["finish_reason"] == "tool_calls"
    assert got["message"]["content"] == want["message"]["content"]
    # the tool calls as the backend parsed them, under the policy's own ids
    functions = [c["function"] for c in got["message"]["tool_calls"]]
    assert functions == [c["function"] for c in want["message"]["tool_calls"]]
    assert got["message"]["tool_calls"][0]["id"].startswith("call_")
    entries = [(e["token"], e["logprob"]) for e in got["logprobs"]["content"]]
    assert entries == [(e["token"], e["logprob"]) for e in want["logprobs"]["content"]]
    assert reply["usage"] == whole["usage"]
    # a second serve answers the same, tool call ids included
    again, _, _ = await one_call(http, body, stream=True, cut=cut, parser=hermes)
    assert again["choices"][0]["message"] == got["message"]
    assert len(read_call_log(log)) == 1  # the one call that generated
    scores = read_scores(log)
    assert [(s["turn"], s["prompt"]) for s in scores] == [(0, "[p1] add 1")] * 2

    # a text turn needs no parser; a request with tools and no parser regenerates
    text_turn = {**request(), "messages": [*request()["messages"], *turn_messages(whole)]}
    plain, plain_call, _ = await one_call(http, text_turn, stream=False, cut=None)
    cut = GenerationPrefix("p1.c1", "p1.c0", "d", tuple(plain_call.token_ids), True, 0, None)
    served, call, _ = await one_call(http, text_turn, stream=False, cut=cut)
    assert call.served and served["choices"][0]["message"] == plain["choices"][0]["message"]
    cut = GenerationPrefix("p1.c0", None, "d", tuple(whole_call.token_ids), True, 0, None)
    _, refused, _ = await one_call(http, body, stream=False, cut=cut)
    assert refused.policy.cuts_refused == 1 and not refused.served
    assert len(read_call_log(log)) == 3  # the text turn's call, and the regenerated one


def turn_messages(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply's assistant message and a tool result for each of its calls."""
    message = reply["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"success": true}'}
        for c in message.get("tool_calls") or ()
    ]
    return [{"role": "assistant", **message}, *results]


async def test_constrained_decoding_is_never_streamed_nor_continued(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, log = backend
    body = request(tool_choice="required")
    _, call, events = await one_call(http, body, stream=True, cut=None)
    assert call.generation.constrained and events == []
    cut = GenerationPrefix("p1.c0-old", None, "d", tuple(call.token_ids[:8]), False, 0, None)
    _, again, events = await one_call(http, body, stream=True, cut=cut)
    assert again.policy.cuts_refused == 1 and again.generation.call_id == "p1.c0"
    assert again.token_ids == call.token_ids and events == []
    assert [(c["stream"], c["continued"]) for c in read_call_log(log)] == [(False, 0)] * 2


async def test_the_fake_backend_refuses_a_prefix_it_did_not_generate(
    backend: tuple[httpx.AsyncClient, Path],
) -> None:
    http, _ = backend
    body = request()
    body["messages"] = [*body["messages"], {"role": "assistant", "content": "not the turn"}]
    response = await http.post(
        "/v1/chat/completions", json={**body, "continue_final_message": True}
    )
    assert response.status_code == 400
    tokens = await http.post("/tokenize", json={"prompt": "héllo"})
    detokenized = await http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert detokenized.json()["prompt"] == "héllo"
