"""NeMo Gym's ``vllm_model`` server as a rolloutlog policy participant.

``RolloutlogVLLMModel`` subclasses ``responses_api_models.vllm_model.app.VLLMModel``; for every
``/v1/responses`` call of a rollout (a request with ``x-rolloutlog-capture-key``):

- **lineage**: the model-authored items of the request's input (assistant messages, function
  calls, reasoning; normalized: text, name, arguments and call id, never NeMo Gym's random item
  ids) are fingerprinted and resolved to exactly one parent row of the attempt, or none; the
  context the parent was called with (the input before its output) must match;
- **ledger row**: once vllm_model has the reply, a ``ledger.row`` with the call's generated token
  ids is appended and acknowledged before the reply leaves (``Policy.record_call``), with the
  call's last generation chunk (``done``: ``Generation.deliver``) in the same append;
- **restores**: a replacement attempt's first call installs the rows the restore kept under the
  new capture key (or all of them at start, with ``restore_id``), so its parents resolve; its
  restored generation cut is validated (``Policy.validate_cut``) and continued, or served from
  its tokens when the call had completed (a terminal cut);
- **backend calls**: streamed with generation chunks, continued from a cut, or plain
  (``_backend.CallClient``).

Calls without a capture key, Responses-native models (``is_responses_native``) and the
``/v1/chat/completions`` route pass through unrecorded.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
import orjson
from fastapi import Body, FastAPI, Request
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from pydantic import BaseModel, PrivateAttr
from responses_api_models.vllm_model.app import VLLMModel

from rolloutlog.integrations.nemo_gym._attach import Attachment
from rolloutlog.integrations.nemo_gym._backend import CALL, CallClient, CallState
from rolloutlog.integrations.nemo_gym._config import GymSettings
from rolloutlog.integrations.nemo_gym._context import GymContextMiddleware
from rolloutlog.integrations.nemo_gym._parsers import tool_parser
from rolloutlog.participants import (
    GenerationPrefix,
    Policy,
    RolloutContext,
    Transport,
    current_context,
    fingerprint,
)

__all__ = ["POLICY_OPTIONS", "RolloutlogVLLMModel", "model_turns", "normalized_items"]

#: Output item types the model authors (the rest of an input is the user's, the tools').
MODEL_AUTHORED = frozenset({"reasoning", "function_call", "assistant"})


#: Defaults of the policy's own ``rolloutlog:`` options (``GymSettings.options``).
POLICY_OPTIONS: dict[str, Any] = {
    "policy_version": 0,
    # a generation chunk every ``chunk_tokens`` streamed tokens
    "chunk_tokens": 256,
    # stream from the backend, so that calls in flight leave durable cuts
    "stream": False,
    # a cut whose text holds (or ends with the start of) one of these regenerates instead of
    # being continued: a tool-call or reasoning parser must see that markup whole
    "cut_unsafe_markers": ["<tool_call>", "<think>"],
    # the backend's tool-call format (vLLM's --tool-call-parser: "hermes", or "module:function"):
    # a terminal cut of a request with tools is served from its tokens only with one
    "tool_parser": None,
    # how many recent calls ``GET /rolloutlog/stats`` lists
    "stats_calls": 1024,
}


def _dump(item: Any) -> dict[str, Any]:
    if isinstance(item, BaseModel):
        return item.model_dump()
    return dict(item)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(_dump(part).get("text", "")) for part in content or ())


def normalized_items(items: Iterable[Any]) -> list[dict[str, Any]]:
    """Input or output items as lineage sees them: what the model or the user said, without
    item ids, statuses or token information."""
    normal: list[dict[str, Any]] = []
    for raw in items:
        item = _dump(raw)
        kind = item.get("type") or "message"
        if kind == "message":
            role = item.get("role")
            kind = "assistant" if role == "assistant" else "message"
            normal.append({"type": kind, "role": role, "text": _text(item.get("content"))})
        elif kind == "function_call":
            names = ("name", "arguments", "call_id")
            normal.append({"type": kind, **{k: item.get(k) for k in names}})
        elif kind == "function_call_output":
            normal.append(
                {"type": kind, "call_id": item.get("call_id"), "output": item.get("output")}
            )
        elif kind == "reasoning":
            summary = [_dump(s).get("text") for s in item.get("summary") or ()]
            normal.append({"type": kind, "summary": summary})
        else:
            normal.append({"type": kind, "item": item})
    return normal


def model_turns(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model-authored ones among normalized items."""
    return [item for item in items if item["type"] in MODEL_AUTHORED]


def _runs(items: list[dict[str, Any]]) -> list[int]:
    """Where each run of model-authored items starts (one run per earlier model call)."""
    starts = []
    for i, item in enumerate(items):
        authored = item["type"] in MODEL_AUTHORED
        if authored and (i == 0 or items[i - 1]["type"] not in MODEL_AUTHORED):
            starts.append(i)
    return starts


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _request_view(body: NeMoGymResponseCreateParamsNonStreaming) -> dict[str, Any]:
    """The request fields a constrained-decoding check reads (``constrained_request``)."""
    view: dict[str, Any] = {"tool_choice": body.tool_choice}
    text = body.text if isinstance(body.text, Mapping) else None
    if text and isinstance(text.get("format"), Mapping):
        view["response_format"] = {"type": text["format"].get("type", "text")}
    return view


class RolloutlogVLLMModel(VLLMModel):
    """``VLLMModel`` recording a ledger row per delivered call (module docstring). Its settings
    come from the NeMo Gym config (``GymSettings``; the server's own ``rolloutlog:`` options:
    ``POLICY_OPTIONS``); without a run configured it is NeMo Gym's ``VLLMModel``."""

    _attachment: Attachment[Policy] | None = PrivateAttr(default=None)
    _options: dict[str, Any] = PrivateAttr(default_factory=dict)
    _http: httpx.AsyncClient | None = PrivateAttr(default=None)
    #: capture key -> its projection, until the attempt's first call took the cut
    _cuts: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)
    _fetched: set[str] = PrivateAttr(default_factory=set)
    _locks: dict[str, asyncio.Lock] = PrivateAttr(default_factory=dict)
    _calls: collections.deque[dict[str, Any]] = PrivateAttr(default_factory=collections.deque)

    def setup_webserver(self) -> FastAPI:
        app: FastAPI = super().setup_webserver()
        settings = GymSettings.from_config(self.server_client.global_config_dict, self.config.name)
        if settings is None:
            return app
        options = self._options = {**POLICY_OPTIONS, **settings.options}

        def make(transport: Transport, participant_id: str) -> Policy:
            return Policy(
                transport,
                settings.run,
                participant_id,
                policy_version=int(options["policy_version"]),
                chunk_tokens=int(options["chunk_tokens"]),
            )

        self._attachment = Attachment(settings, make, workers=self.config.num_workers)
        self._attachment.on_start.append(self._bulk_install)
        self._attachment.on_stop.append(self._close)
        self._attachment.attach(app)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self._calls = collections.deque(maxlen=int(options["stats_calls"]))
        app.get("/rolloutlog/stats")(self.rolloutlog_stats)
        return app

    def rolloutlog_app(self, app: FastAPI, settings: GymSettings) -> Any:
        """What the launcher serves (``_launcher.build_app``): the app, rolloutlog attached by
        ``setup_webserver``, behind ``GymContextMiddleware`` (a context sent as cookies)."""
        return GymContextMiddleware(app, liveness=app)

    async def _close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    @property
    def policy(self) -> Policy:
        assert self._attachment is not None, "no rolloutlog run is configured"
        return self._attachment.participant

    async def rolloutlog_stats(self) -> dict[str, Any]:
        """This participant's counters and its recent calls (``call_id``, ``parent_call_id``,
        ``capture_key``, ``continued``, ``served`` (a terminal cut, nothing generated),
        ``tokens``, ``constrained``, ``chunks``)."""
        policy = self.policy
        return {
            "participant": policy.id,
            "epoch": policy.epoch,
            "parents": policy.parents,
            "cuts_refused": policy.cuts_refused,
            "chunks_skipped": policy.chunks_skipped,
            "calls": list(self._calls),
        }

    # -- restores ----------------------------------------------------------------------------

    def _keep(self, projection: dict[str, Any]) -> None:
        key = str(projection["capture_key"])
        self.policy.install(projection)
        self._fetched.add(key)
        if projection.get("generation_cut") is not None:
            self._cuts[key] = projection

    async def _bulk_install(self) -> None:
        """With option ``restore_id``: every continued episode's rows at start."""
        assert self._attachment is not None
        restore_id = self._options.get("restore_id")
        if restore_id is None:
            return
        run, restores = self._attachment.settings.run, self._attachment.restores
        async for projection in restores.install(run, int(restore_id), kind="policy"):
            self._keep(projection)

    async def _restored(self, context: RolloutContext) -> None:
        key = context.capture_key
        if context.attempt == 0 or key in self._fetched:
            return
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in self._fetched:
                assert self._attachment is not None
                projection = await self._attachment.projection(context)
                if projection is not None:
                    self._keep(projection)
                self._fetched.add(key)

    def _take_cut(self, context: RolloutContext, request_digest: str) -> GenerationPrefix | None:
        projection = self._cuts.pop(context.capture_key, None)
        if projection is None or not self.policy.claim_cut(context.capture_key):
            return None
        return self.policy.validate_cut(projection, request_digest=request_digest)

    # -- calls -------------------------------------------------------------------------------

    def _resolve_client(self, request: Request) -> Any:
        client = super()._resolve_client(request)
        call = CALL.get()
        if call is None or self._http is None:
            return client
        return CallClient(client, call, self._http)

    def _call_id(self, context: RolloutContext, index: int) -> str:
        base = f"{context.capture_key}.c{index}"
        call_id, n = base, 1
        while self.policy.ledger.get(context.capture_key, call_id) is not None:
            n += 1
            call_id = f"{base}.{n}"
        return call_id

    async def responses(
        self,
        request: Request,
        body: NeMoGymResponseCreateParamsNonStreaming = Body(),  # noqa: B008 (FastAPI's way)
    ) -> NeMoGymResponse:
        attachment, context = self._attachment, current_context()
        if attachment is None or context is None or self.config.is_responses_native:
            return await super().responses(request, body)
        with attachment.restore(request.headers):
            return await self._recorded(context, request, body)

    async def _recorded(
        self,
        context: RolloutContext,
        request: Request,
        body: NeMoGymResponseCreateParamsNonStreaming,
    ) -> NeMoGymResponse:
        policy, options = self.policy, self._options
        await self._restored(context)
        if isinstance(body.input, str):
            items = [{"type": "message", "role": "user", "text": body.input}]
        else:
            items = normalized_items(body.input)
        turns = model_turns(items)
        runs = _runs(items)
        parent = None
        if turns:  # the parent was called with what precedes its own output, the last run
            parent = policy.resolve_parent(
                context, fingerprint(turns), context_digest=_digest(items[: runs[-1]])
            )
        tools = [_dump(tool) for tool in body.tools]
        request_digest = _digest({"items": items, "tools": tools, "model": body.model})
        cut = self._take_cut(context, request_digest)
        fresh_id = self._call_id(context, len(runs))
        view = _request_view(body)
        generation = policy.generation(
            context,
            cut.call_id if cut is not None else fresh_id,
            parent_call_id=parent.call_id if parent is not None else None,
            request_digest=request_digest,
            request=view,
            cut=cut,
        )
        call = CallState(
            policy,
            generation,
            cut,
            fresh_id,
            bool(options["stream"]),
            list(options["cut_unsafe_markers"]),
            tool_parser(options["tool_parser"]),
        )
        token = CALL.set(call)
        try:
            response = await super().responses(request, body)
        finally:
            CALL.reset(token)
        generation = call.generation  # a new one if the cut had to regenerate
        out = model_turns(normalized_items(response.output))
        # its last chunk rides with its row: delivered after the episode's last boundary, the
        # call is a terminal cut that a replacement serves instead of generating it again
        done = await generation.deliver(call.token_ids) if call.token_ids else None
        row = await policy.record_call(
            context,
            generation.call_id,
            call.token_ids,
            fingerprint=fingerprint([*turns, *out]),
            context_digest=_digest(items),
            parent_call_id=generation.parent_call_id,
            constrained=generation.constrained,
            policy_version=generation.policy_version,
        )
        if done is not None:
            await done
        self._calls.append(
            {
                "capture_key": context.capture_key,
                "call_id": row.call_id,
                "parent_call_id": row.parent_call_id,
                "continued": call.continued,
                "served": call.served,
                "tokens": len(call.token_ids),
                "constrained": row.constrained,
                "chunks": generation.chunks,
            }
        )
        return response
