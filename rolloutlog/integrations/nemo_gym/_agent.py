"""NeMo Gym's Simple Agent as a rolloutlog agent participant.

``RolloutlogSimpleAgent`` subclasses ``responses_api_agents.simple_agent.app.SimpleAgent`` and
changes none of its loop. Two things attach to it:

- its ``ServerClient`` becomes a ``RolloutServerClient``, which puts the rollout context of the
  request being served (``x-rolloutlog-capture-key``, ``x-rolloutlog-step``) on every post it
  makes (``/seed_session``, ``/v1/responses``, the tools, ``/verify``), and tells the running
  loop about each model call before it leaves;
- ``/v1/responses`` runs the loop inside an agent session (``rolloutlog.participants.Agent``):
  before each model call the session takes a lazy boundary snapshot of the loop state — the
  output items so far and the usage — labelled ``tool_round`` when a tool round ended since the
  last one (the SDK's ``after_tool_round``), else ``model_call`` (``before_model_call``). Every
  model post carries the loop's whole state (``input`` = the original input plus every output
  so far), so the snapshot is taken from the post itself.

A replacement attempt (``r17-a1``) of ``/v1/responses`` resumes: the session's last snapshot
comes from the restore's projection, and the loop is invoked again with the original input
plus the restored output items, which is how NeMo Gym continues a loop; the reply carries the
restored items before the new ones and the usage of both.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Body, FastAPI, Request, Response
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.server_utils import ServerClient
from pydantic import BaseModel, PrivateAttr, TypeAdapter
from responses_api_agents.simple_agent.app import (
    SimpleAgent,
    SimpleAgentRunRequest,
    SimpleAgentVerifyResponse,
)

from rolloutlog.integrations.nemo_gym._attach import Attachment, restore_headers
from rolloutlog.integrations.nemo_gym._config import GymSettings
from rolloutlog.integrations.nemo_gym._context import GymContextMiddleware
from rolloutlog.participants import (
    Agent,
    AgentSession,
    RolloutContext,
    Transport,
    context_headers,
    current_context,
)

__all__ = ["RolloutServerClient", "RolloutlogSimpleAgent"]

_USAGE_FIELDS = ("input_tokens", "output_tokens", "total_tokens")


@dataclass
class _Loop:
    """One ``/v1/responses`` loop in an agent session: where the outputs start in the model
    posts' ``input``, and the usage of every model call so far."""

    session: AgentSession
    model_server: str
    start: int
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_USAGE_FIELDS, 0))
    snapshotted: int = 0

    async def before_model_call(self, items: list[Any]) -> None:
        outputs = items[self.start :]
        state = {"outputs": outputs, "usage": dict(self.usage)}
        fresh = outputs[self.snapshotted :]
        self.snapshotted = len(outputs)
        if any(_kind(item) == "function_call_output" for item in fresh):
            await self.session.after_tool_round(state)
        else:
            await self.session.before_model_call(state)

    def count(self, reply: bytes) -> None:
        usage = orjson.loads(reply).get("usage") or {}
        for name in _USAGE_FIELDS:
            self.usage[name] += int(usage.get(name) or 0)


_LOOP: contextvars.ContextVar[_Loop | None] = contextvars.ContextVar(
    "rolloutlog_nemo_gym_loop", default=None
)


def _kind(item: Any) -> str | None:
    return item.get("type") if isinstance(item, dict) else getattr(item, "type", None)


class RolloutServerClient(ServerClient):
    """A ``ServerClient`` that forwards the rollout context and reports model calls to the
    ``/v1/responses`` loop it runs in (if any)."""

    @classmethod
    def of(cls, client: ServerClient) -> RolloutServerClient:
        if isinstance(client, cls):
            return client
        return cls(
            head_server_config=client.head_server_config,
            global_config_dict=client.global_config_dict,
        )

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        context = current_context()
        if context is not None:
            headers = {**context_headers(context), **restore_headers()}
            kwargs["headers"] = {**(kwargs.get("headers") or {}), **headers}
        loop = _LOOP.get()
        if loop is None or server_name != loop.model_server or url_path != "/v1/responses":
            return await super().request(server_name, url_path, method, **kwargs)
        body = kwargs.get("json")
        if isinstance(body, BaseModel):
            # dumped once, here, as ``ServerClient.request`` would dump it
            body = kwargs["json"] = body.model_dump(exclude_unset=True)
        await loop.before_model_call(list(body["input"]) if isinstance(body, dict) else [])
        response = await super().request(server_name, url_path, method, **kwargs)
        if response.ok:
            loop.count(await response.read())  # aiohttp keeps the body for the agent's read
        return response


class RolloutlogSimpleAgent(SimpleAgent):
    """``SimpleAgent`` recording its loop in rolloutlog (module docstring). Its settings come
    from the NeMo Gym config (``GymSettings``; the server's own ``rolloutlog:`` options:
    ``deltas``, default true); without a run configured it is NeMo Gym's ``SimpleAgent``."""

    server_client: ServerClient  # NeMo Gym's field, named for the type checker
    _attachment: Attachment[Agent] | None = PrivateAttr(default=None)

    def setup_webserver(self) -> FastAPI:
        client = self.server_client
        settings = GymSettings.from_config(client.global_config_dict, self.config.name)
        if settings is None:
            stock: FastAPI = super().setup_webserver()
            return stock
        self.server_client = RolloutServerClient.of(client)
        app: FastAPI = super().setup_webserver()
        deltas = bool(settings.options.get("deltas", True))

        def make(transport: Transport, participant_id: str) -> Agent:
            return Agent(transport, settings.run, participant_id, deltas=deltas)

        self._attachment = Attachment(settings, make, workers=self.config.num_workers)
        self._attachment.attach(app, exempt=("/aggregate_metrics",))
        return app

    def rolloutlog_app(self, app: FastAPI, settings: GymSettings) -> Any:
        """What the launcher serves (``_launcher.build_app``): the app, rolloutlog attached by
        ``setup_webserver``, behind ``GymContextMiddleware`` (a context sent as cookies)."""
        return GymContextMiddleware(app, liveness=app)

    def session_id(self, agent: Agent, episode: str) -> str:
        """The episode's agent session (the owner of its boundaries), stable across attempts."""
        return f"{agent.id}:{episode}"

    async def run(self, request: Request, body: SimpleAgentRunRequest) -> SimpleAgentVerifyResponse:
        attachment = self._attachment
        if attachment is None:
            return await super().run(request, body)
        with attachment.restore(request.headers):
            return await super().run(request, body)

    async def responses(
        self,
        request: Request,
        response: Response,
        body: NeMoGymResponseCreateParamsNonStreaming = Body(),  # noqa: B008 (FastAPI's way)
    ) -> NeMoGymResponse:
        attachment = self._attachment
        context = current_context()
        if attachment is None or context is None:  # not a rollout: NeMo Gym's loop, unrecorded
            return await super().responses(request, response, body)
        with attachment.restore(request.headers):
            return await self._recorded(attachment, context, request, response, body)

    async def _recorded(
        self,
        attachment: Attachment[Agent],
        context: RolloutContext,
        request: Request,
        response: Response,
        body: NeMoGymResponseCreateParamsNonStreaming,
    ) -> NeMoGymResponse:
        agent = attachment.participant
        original = body.input
        if isinstance(original, str):
            original = [NeMoGymEasyInputMessage(role="user", content=original)]
        sid = self.session_id(agent, context.episode)
        session: AgentSession | None = None
        restored: dict[str, Any] = {}
        projection = await attachment.projection(context)
        if projection is not None:
            session, state, _ = agent.resume(projection, sid)
            restored = state if isinstance(state, dict) else {}
        if session is None:
            session = await agent.open_session(context, sid)
        outputs = list(restored.get("outputs", ()))
        loop = _Loop(session, self.config.model_server.name, len(original))
        loop.snapshotted = len(outputs)
        for name in _USAGE_FIELDS:
            loop.usage[name] = int((restored.get("usage") or {}).get(name, 0))
        resumed = body
        if outputs or original is not body.input:
            resumed = body.model_copy(update={"input": [*original, *_as(body, "input", outputs)]})
        token = _LOOP.set(loop)
        try:
            result = await super().responses(request, response, resumed)
        finally:
            _LOOP.reset(token)
        await session.close()
        if not outputs:
            return result
        usage = result.usage
        if usage is not None:
            usage = usage.model_copy(update=loop.usage)
        output = [*_as(result, "output", outputs), *result.output]
        return result.model_copy(update={"output": output, "usage": usage})


def _as(model: BaseModel, field_name: str, items: list[Any]) -> list[Any]:
    """Restored items (JSON) as the item types of a NeMo Gym model's list field."""
    if not items:
        return []
    annotation: Any = type(model).model_fields[field_name].annotation
    validated: list[Any] = _adapter(annotation).validate_python(items)
    return validated


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(annotation)
