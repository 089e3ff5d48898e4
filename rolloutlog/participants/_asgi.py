"""ASGI integration: the rollout context of a request, read from its headers.

Headers (case-insensitive, as ASGI delivers them lower-cased):

- ``x-rolloutlog-capture-key``: the attempt's capture key (``r17``, ``r17-a2``);
- ``x-rolloutlog-step``: the episode's step (an integer), optional.

``RolloutContextMiddleware`` puts the context of each request in a context variable that
``current_context()`` reads (None outside a rollout request); ``rollout_context`` is the same as a
FastAPI dependency. A malformed header is refused with 400 ``invalid_request``.

Both middlewares pass a request without a capture key through by default (health checks, a
client that is not a rollout). With ``rollout_id_required=True`` they refuse it instead (400
``invalid_request``, field ``x-rolloutlog-capture-key``), except under the path prefixes in
``exempt`` (e.g. ``("/health",)``): work done outside any rollout is work no checkpoint can
account for.

Plain ASGI: the middlewares need no web framework (the participant SDK installs none). Only
``rollout_context``, a FastAPI dependency, names starlette's ``Request``, when it is installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import orjson

from rolloutlog.errors import InvalidRequest
from rolloutlog.participants._participant import RolloutContext

if TYPE_CHECKING:
    from starlette.requests import Request

    from rolloutlog.participants._sessions import Resources
else:
    try:  # FastAPI reads ``rollout_context``'s annotation from this module's globals
        from starlette.requests import Request
    except ModuleNotFoundError:  # the base install: no FastAPI app to depend on it
        Request = None

__all__ = [
    "CAPTURE_KEY_HEADER",
    "STEP_HEADER",
    "ResourcesMiddleware",
    "RolloutContextMiddleware",
    "context_headers",
    "current_context",
    "rollout_context",
]

CAPTURE_KEY_HEADER = "x-rolloutlog-capture-key"
STEP_HEADER = "x-rolloutlog-step"

# The ASGI interface's types, as the ASGI specification (and ``starlette.types``) spell them.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_CURRENT: ContextVar[RolloutContext | None] = ContextVar("rolloutlog_context", default=None)


def parse_context(capture_key: str | None, step: str | None) -> RolloutContext | None:
    """The context two header values name (None without a capture key)."""
    if capture_key is None:
        return None
    try:
        step_value = None if step is None else int(step)
        if step_value is not None and step_value < 0:
            raise ValueError("negative step")
        return RolloutContext.of(capture_key, step_value)
    except ValueError as e:
        raise InvalidRequest(f"bad rollout context headers: {e}", field=CAPTURE_KEY_HEADER) from e


def context_headers(context: RolloutContext) -> dict[str, str]:
    """The headers that carry ``context`` to the next participant."""
    headers = {CAPTURE_KEY_HEADER: context.capture_key}
    if context.step is not None:
        headers[STEP_HEADER] = str(context.step)
    return headers


def current_context() -> RolloutContext | None:
    """The rollout context of the request being handled (under the middleware)."""
    return _CURRENT.get()


def rollout_context(request: Request) -> RolloutContext | None:
    """FastAPI dependency: the request's rollout context (``Depends(rollout_context)``)."""
    return parse_context(request.headers.get(CAPTURE_KEY_HEADER), request.headers.get(STEP_HEADER))


class _Required:
    """``rollout_id_required``: which requests without a capture key are refused."""

    def __init__(self, required: bool, exempt: Sequence[str]) -> None:
        self.required = required
        self.exempt = tuple(exempt)

    def refuses(self, scope: Scope) -> InvalidRequest | None:
        if not self.required or str(scope.get("path", "")).startswith(self.exempt):
            return None
        return InvalidRequest(
            f"a rollout request needs the {CAPTURE_KEY_HEADER} header (rollout_id_required)",
            field=CAPTURE_KEY_HEADER,
        )


class RolloutContextMiddleware:
    """Pure ASGI middleware: sets ``current_context()`` for each HTTP request (and refuses one
    without a rollout context when ``rollout_id_required``, outside the ``exempt`` prefixes)."""

    def __init__(
        self, app: ASGIApp, *, rollout_id_required: bool = False, exempt: Sequence[str] = ()
    ) -> None:
        self.app = app
        self.required = _Required(rollout_id_required, exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = step = None
        for name, value in scope.get("headers", ()):
            if name == b"x-rolloutlog-capture-key":
                key = value.decode("latin-1")
            elif name == b"x-rolloutlog-step":
                step = value.decode("latin-1")
        try:
            context = parse_context(key, step)
        except InvalidRequest as e:
            await _refuse(send, e)
            return
        if context is None and (refusal := self.required.refuses(scope)) is not None:
            await _refuse(send, refusal)
            return
        token = _CURRENT.set(context)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


async def _refuse(send: Send, error: InvalidRequest) -> None:
    body = orjson.dumps(error.to_dict())
    headers: list[Any] = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


#: Returns the state of a session to record before a reply (``exported`` servers).
StateHook = Callable[[RolloutContext, str], Awaitable[Any]]


class ResourcesMiddleware:
    """A resources server's session lifecycle, inferred from its routes (keyed by the attempt
    in ``x-rolloutlog-capture-key``), each recorded before the reply leaves:

    - ``…/seed_session``: ``session.started``; the reply gets ``resources.headers``
      (``x-ng-checkpoint-verify``, and ``x-ng-checkpoint-restart: 1`` when restart-only);
    - every successful reply of a rollout request, for ``exported`` servers with a ``state``
      hook: ``session.state`` (so ``/verify`` and tool calls record the state they leave);
    - ``…/close_session``: ``session.ended``.

    The session id is ``"<resources id>:<episode>"`` (stable across attempts, so a replacement
    finds its restored state under it); requests without a capture key pass through untouched,
    or are refused with ``rollout_id_required`` (outside the ``exempt`` prefixes).
    ``resources_for`` (optional) picks the participant per request (a server that serves several
    runs, a fork beside its run: each run's own ``Resources``); ``resources`` otherwise.
    """

    def __init__(
        self,
        app: ASGIApp,
        resources: Resources,
        *,
        state: StateHook | None = None,
        rollout_id_required: bool = False,
        exempt: Sequence[str] = (),
        resources_for: Callable[[Scope], Awaitable[Resources]] | None = None,
    ) -> None:
        self.app = app
        self.resources = resources
        self.resources_for = resources_for
        self.state = state
        self.required = _Required(rollout_id_required, exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        key = headers.get(CAPTURE_KEY_HEADER.encode())
        if key is None:
            if (refusal := self.required.refuses(scope)) is not None:
                await _refuse(send, refusal)
                return
            await self.app(scope, receive, send)
            return
        step = headers.get(STEP_HEADER.encode())
        try:
            context = parse_context(key.decode("latin-1"), step and step.decode("latin-1"))
        except InvalidRequest as e:
            await _refuse(send, e)
            return
        assert context is not None
        path: str = scope["path"]
        resources = (
            self.resources if self.resources_for is None else await self.resources_for(scope)
        )
        sid = resources.session_id(context)

        async def recorded(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                if path.endswith("/seed_session"):
                    await resources.open_session(context, sid)
                    extra = [(k.encode(), v.encode()) for k, v in resources.headers.items()]
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
                if path.endswith("/close_session"):
                    await resources.end_session(context, sid)
                elif self.state is not None and resources.mode == "exported":
                    await resources.record_state(context, sid, await self.state(context, sid))
            await send(message)

        token = _CURRENT.set(context)
        try:
            await self.app(scope, receive, recorded)
        finally:
            _CURRENT.reset(token)
