"""The policy server's side of its inference backend: one model call, streamed or continued.

``vllm_model`` asks ``_resolve_client(request)`` for the client of each call and calls its
``create_chat_completion(**body)``; the policy server hands it a ``CallClient`` instead, which
answers with the same Chat Completion dict after doing what the call needs:

- **token ids**: taken from the reply's log probabilities (``token_id:N``, which vllm_model asks
  for with ``return_token_id_information: true``);
- **streaming** (``rolloutlog.stream``): the backend streams (Server-Sent Events, with token ids
  asked for) and every ``chunk_tokens`` tokens become a durable ``generation.chunk`` while the
  call runs; the stream is assembled into the reply vllm_model expects. Constrained calls are not
  streamed (never cut);
- **continuing a restored cut**: the prefix's text (``/detokenize``) is sent as the final
  assistant message with ``continue_final_message`` (vLLM's way to continue a message), the
  prefix's log probabilities come back as ``prompt_logprobs``, and the reply is the prefix plus
  what was generated. A cut that cannot be continued regenerates (``Policy.refuse_cut``): its
  text holds markup a tool or reasoning parser must see whole (``cut_unsafe_markers``), or the
  backend could not detokenize it or did not give its tokens back unchanged;
- **serving a terminal cut** (a call that completed, and was maybe delivered, after its
  episode's last boundary): nothing is generated. Its text comes from ``/detokenize``, its tool
  calls from the policy's ``tool_parser`` (the backend's own format: the backend parses tool
  calls out of the text, so a request with tools needs one), its log probabilities from a
  prefill of the prompt (``/tokenize``) and its tokens (``/v1/completions`` with ``echo`` and
  ``max_tokens: 0``, vLLM's scoring form). A text the parser cannot read, or that holds other
  unsafe markup (``<think>``), regenerates.

A backend error on a streamed or continued call is answered by the stock client with the
original request, so vllm_model's own error handling (context length → empty reply) applies.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from rolloutlog.integrations.nemo_gym._parsers import ToolParser, UnparsedMarkup, parsed_message
from rolloutlog.participants import Generation, GenerationPrefix, Policy, constrained_request

__all__ = ["CALL", "CallClient", "CallState"]

#: What a call asks the backend for to get its token ids (vLLM's request fields).
_TOKEN_IDS = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True}


@dataclass
class CallState:
    """One ``/v1/responses`` call of a rollout: its generation and the restored cut it
    continues (if any). ``token_ids`` is what the ledger row records."""

    policy: Policy
    generation: Generation
    cut: GenerationPrefix | None
    #: the call id the call takes when a cut it would continue has to regenerate instead
    fresh_call_id: str
    stream: bool
    unsafe_markers: Sequence[str]
    #: the backend's tool-call format, for serving terminal cuts of requests with tools
    tool_parser: ToolParser | None = None
    token_ids: list[int] = field(default_factory=list)
    continued: int = 0
    #: a terminal cut served from its tokens: nothing generated
    served: bool = False

    def regenerate(self) -> None:
        """Give up the cut: the call generates from its start under ``fresh_call_id``."""
        old = self.generation
        self.generation = self.policy.generation(
            old.context,
            self.fresh_call_id,
            parent_call_id=old.parent_call_id,
            request_digest=old.request_digest,
            constrained=old.constrained,
            staging_key=old.staging_key,
        )
        self.cut = None
        self.token_ids = []
        self.continued = 0


CALL: contextvars.ContextVar[CallState | None] = contextvars.ContextVar(
    "rolloutlog_nemo_gym_call", default=None
)


class _Unusable(Exception):
    """A continuation that cannot stand for the call (the reason is its message)."""


class CallClient:
    """Stands in for vllm_model's client during one call (module docstring)."""

    def __init__(self, inner: Any, call: CallState, http: httpx.AsyncClient) -> None:
        self._inner = inner
        self._call = call
        self._http = http

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def create_chat_completion(self, **body: Any) -> Any:
        call = self._call
        if constrained_request(body):
            call.generation.constrained = True
        cut = call.cut
        if cut is not None:
            key = call.generation.context.capture_key
            try:
                if call.generation.constrained:
                    raise _Unusable("constrained")
                if cut.terminal:
                    return await self._served(body, cut)
                return await self._continued(body, cut)
            except (_Unusable, httpx.HTTPError) as e:
                reason = str(e) if isinstance(e, _Unusable) else "backend_error"
                call.policy.refuse_cut(cut.call_id, key, reason)
                call.regenerate()
        if call.stream and not call.generation.constrained:
            streamed = await self._streamed(body, [], [])
            if streamed is not None:
                return streamed
        reply = await self._inner.create_chat_completion(**body)
        entries = ((reply.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
        call.token_ids = _token_ids(entries)
        return reply

    # -- the backend's routes ----------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        inner = self._inner
        return {**(inner.default_headers or {}), "Authorization": f"Bearer {inner.api_key}"}

    async def _detokenize(self, model: Any, token_ids: Sequence[int]) -> str:
        base = str(self._inner.base_url).removesuffix("/v1")
        body = {"model": model, "tokens": list(token_ids)}
        return str((await self._post(f"{base}/detokenize", body, "detokenize_failed"))["prompt"])

    async def _post(self, url: str, body: Mapping[str, Any], refused: str) -> Any:
        response = await self._http.post(
            url,
            content=orjson.dumps(body),
            headers={**self._headers(), "Content-Type": "application/json"},
        )
        if response.status_code >= 400:
            raise _Unusable(refused)
        return orjson.loads(response.content)

    async def _served(self, body: dict[str, Any], cut: GenerationPrefix) -> dict[str, Any]:
        """The reply of a terminal cut, from its tokens, with no token generated."""
        call = self._call
        text = await self._detokenize(body.get("model"), cut.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if body.get("tools"):
            if call.tool_parser is None:
                raise _Unusable("no_tool_parser")
            try:
                message = parsed_message(call.tool_parser, text, cut.call_id)
            except UnparsedMarkup as e:
                raise _Unusable("unparsed_markup") from e
        content = message.get("content") or ""
        if any(marker in content for marker in call.unsafe_markers):
            raise _Unusable("unsafe_prefix")
        base = str(self._inner.base_url).removesuffix("/v1")
        # what vllm_model tokenizes a prompt with (its own prompt_token_ids come the same way)
        fields = ("model", "messages", "tools", "chat_template_kwargs")
        template: dict[str, Any] = {k: body[k] for k in fields if k in body}
        prompt = (await self._post(f"{base}/tokenize", template, "tokenize_failed"))["tokens"]
        logprobs = None
        if body.get("logprobs"):
            scoring = {
                "model": body.get("model"),
                "prompt": [*prompt, *cut.token_ids],
                "echo": True,
                "max_tokens": 0,
                "prompt_logprobs": 0,
            }
            scored = await self._post(
                f"{self._inner.base_url}/completions", scoring, "scoring_refused"
            )
            choice = (scored.get("choices") or [{}])[0]
            found = choice.get("prompt_logprobs", scored.get("prompt_logprobs"))
            logprobs = {"content": _prefix_entries(found, cut.token_ids)}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if finish == "stop" and limit is not None and len(cut.token_ids) >= int(limit):
            finish = "length"
        call.token_ids = list(cut.token_ids)
        call.continued = len(cut.token_ids)
        call.served = True
        return {
            "id": f"chatcmpl-{cut.call_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(cut.token_ids),
                "total_tokens": len(prompt) + len(cut.token_ids),
            },
        }

    async def _streamed(
        self, body: dict[str, Any], prefix: list[dict[str, Any]], extra: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Stream the call (``extra`` messages appended), feeding its tokens to the generation;
        the assembled reply, or None when the backend refused the request."""
        generation = self._call.generation
        request = {**body, **_TOKEN_IDS, "stream": True, "stream_options": {"include_usage": True}}
        if extra:
            request["messages"] = [*body["messages"], *extra]
        reply = _Assembly(wants_logprobs=bool(body.get("logprobs")), prefix=prefix)
        url = f"{self._inner.base_url}/chat/completions"
        headers = {**self._headers(), "Content-Type": "application/json"}
        async with self._http.stream(
            "POST", url, content=orjson.dumps(request), headers=headers
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                tokens = reply.add(orjson.loads(data))
                if tokens:
                    await generation.feed(tokens)
        await generation.complete()
        self._call.token_ids = generation.token_ids
        return reply.result()

    async def _continued(self, body: dict[str, Any], cut: GenerationPrefix) -> dict[str, Any]:
        """The call continued from a restored cut, or ``_Unusable``."""
        call = self._call
        text = await self._detokenize(body.get("model"), cut.token_ids)
        if _unsafe(text, call.unsafe_markers):
            raise _Unusable("unsafe_prefix")
        extra = [{"role": "assistant", "content": text}]
        request = {**body, "continue_final_message": True, "add_generation_prompt": False}
        request["prompt_logprobs"] = 0
        for limit in ("max_tokens", "max_completion_tokens"):
            if body.get(limit) is not None:
                request[limit] = max(0, int(body[limit]) - len(cut.token_ids))
        if call.stream:
            reply = await self._streamed(request, [], extra)
        else:
            reply = await self._once({**request, **_TOKEN_IDS}, extra)
        if reply is None:
            raise _Unusable("continuation_refused")
        prefix = _prefix_entries(reply.pop("prompt_logprobs", None), cut.token_ids)
        choice = reply["choices"][0]
        message = choice["message"]
        message["content"] = text + (message.get("content") or "")
        content = (choice.get("logprobs") or {}).get("content") or []
        choice["logprobs"] = {"content": [*prefix, *content]} if body.get("logprobs") else None
        usage = reply.get("usage")
        if usage:
            usage["prompt_tokens"] -= len(cut.token_ids)
            usage["completion_tokens"] += len(cut.token_ids)
        call.continued = len(cut.token_ids)
        return reply

    async def _once(self, request: dict[str, Any], extra: list[dict[str, Any]]) -> dict[str, Any]:
        """A non-streamed continuation; its token ids go to the generation."""
        generation = self._call.generation
        request = {**request, "messages": [*request["messages"], *extra]}
        response = await self._http.post(
            f"{self._inner.base_url}/chat/completions",
            content=orjson.dumps(request),
            headers={**self._headers(), "Content-Type": "application/json"},
        )
        if response.status_code >= 400:
            raise _Unusable("continuation_refused")
        reply: dict[str, Any] = orjson.loads(response.content)
        entries = (reply["choices"][0].get("logprobs") or {}).get("content") or []
        generation.token_ids.extend(_token_ids(entries))
        self._call.token_ids = generation.token_ids
        return reply


def _token_ids(entries: Sequence[dict[str, Any]]) -> list[int]:
    return [int(str(entry["token"]).removeprefix("token_id:")) for entry in entries]


def _unsafe(text: str, markers: Sequence[str]) -> bool:
    """Whether ``text`` holds a marker, or ends with the start of one."""
    for marker in markers:
        if marker in text or any(text.endswith(marker[:i]) for i in range(1, len(marker))):
            return True
    return False


def _prefix_entries(prompt_logprobs: Any, token_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The continued prefix's log-probability entries, from vLLM's ``prompt_logprobs`` (the
    prompt's last tokens are the prefix's, or the backend tokenized its text differently)."""
    if not token_ids:
        return []
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < len(token_ids):
        raise _Unusable("no_prompt_logprobs")
    entries = []
    for token, position in zip(token_ids, prompt_logprobs[-len(token_ids) :], strict=True):
        found = (position or {}).get(str(token))
        if found is None:
            raise _Unusable("retokenized")
        entries.append({"token": f"token_id:{token}", "logprob": found["logprob"]})
    return entries


@dataclass
class _Assembly:
    """A streamed Chat Completion put back together as the non-streamed reply."""

    wants_logprobs: bool
    prefix: list[dict[str, Any]]
    head: dict[str, Any] = field(default_factory=dict)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    entries: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    prompt_logprobs: Any = None

    def add(self, chunk: dict[str, Any]) -> list[int]:
        """Take one chunk; returns its token ids."""
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_logprobs") is not None:
            self.prompt_logprobs = chunk["prompt_logprobs"]
        tokens: list[int] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self.reasoning.append(reasoning)
            for piece in delta.get("tool_calls") or ():
                self._tool_call(piece)
            entries = (choice.get("logprobs") or {}).get("content") or []
            self.entries.extend(entries)
            tokens.extend(_token_ids(entries))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return tokens

    def _tool_call(self, piece: dict[str, Any]) -> None:
        slot = self.tool_calls.setdefault(
            int(piece.get("index", 0)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if piece.get("id"):
            slot["id"] = piece["id"]
        function = piece.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] = function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]

    def result(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        logprobs = {"content": [*self.prefix, *self.entries]} if self.wants_logprobs else None
        reply: dict[str, Any] = {
            "id": self.head.get("id") or "chatcmpl-stream",
            "object": "chat.completion",
            "created": self.head.get("created") or int(time.time()),
            "model": self.head.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": self.finish_reason or "stop",
                }
            ],
            "usage": self.usage,
        }
        if self.prompt_logprobs is not None:
            reply["prompt_logprobs"] = self.prompt_logprobs
        return reply
