"""ASGI integration: the rollout context of a request, read from its headers.

Headers (case-insensitive, as ASGI delivers them lower-cased):

- ``x-rolloutlog-capture-key``: the attempt's capture key (``r17``, ``r17-a2``);
- ``x-rolloutlog-step``: the episode's step (an integer), optional.

``RolloutContextMiddleware`` puts the context of each request in a context variable that
``current_context()`` reads (None outside a rollout request); ``rollout_context`` is the same as a
FastAPI dependency. A malformed header is refused with 400 ``invalid_request``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from rolloutlog.errors import InvalidRequest
from rolloutlog.participants._participant import RolloutContext

__all__ = [
    "CAPTURE_KEY_HEADER",
    "STEP_HEADER",
    "RolloutContextMiddleware",
    "context_headers",
    "current_context",
    "rollout_context",
]

CAPTURE_KEY_HEADER = "x-rolloutlog-capture-key"
STEP_HEADER = "x-rolloutlog-step"
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


class RolloutContextMiddleware:
    """Pure ASGI middleware: sets ``current_context()`` for each HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
