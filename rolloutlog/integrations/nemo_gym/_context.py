"""The rollout context on NeMo Gym's hops: headers, and cookies where only cookies travel.

The SDK reads a request's rollout context from ``x-rolloutlog-capture-key`` and
``x-rolloutlog-step`` (``rolloutlog.participants``). NeMo Gym 0.4.0's ``SimpleAgent`` forwards
no headers: it passes the cookies of ``/run`` to the resources server's ``/seed_session``, then
each reply's ``Set-Cookie``s to the next call, until ``/verify``. So the collector sends the
context as cookies too (``rollout_cookies``) and ``GymContextMiddleware`` turns them into the
headers the SDK reads, and echoes them on every reply, so they ride the agent's cookie chain
through every tool call to ``/verify``. An agent that forwards the headers needs no cookies.

``x-rolloutlog-restore-id`` (cookie ``rolloutlog-restore-id``) names the restore a replacement
attempt continues from (a participant fetches its projection from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from http.cookies import SimpleCookie
from typing import TYPE_CHECKING, Any

from rolloutlog.participants import CAPTURE_KEY_HEADER, RolloutContext, context_headers

if TYPE_CHECKING:  # plain ASGI: starlette is not needed to run it
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "CAPTURE_KEY_COOKIE",
    "RESTORE_COOKIE",
    "RESTORE_HEADER",
    "GymContextMiddleware",
    "current_gym_session",
    "restore_id_of",
    "rollout_cookies",
    "rollout_headers",
]

RESTORE_HEADER = "x-rolloutlog-restore-id"
CAPTURE_KEY_COOKIE = "rolloutlog-capture-key"
RESTORE_COOKIE = "rolloutlog-restore-id"
#: cookie -> the header it stands for
_COOKIE_HEADERS = {
    CAPTURE_KEY_COOKIE.encode(): CAPTURE_KEY_HEADER.encode(),
    RESTORE_COOKIE.encode(): RESTORE_HEADER.encode(),
}
_SCOPE: ContextVar[Scope | None] = ContextVar("rolloutlog_gym_scope", default=None)


def rollout_headers(context: RolloutContext, restore_id: int | None = None) -> dict[str, str]:
    """The headers that carry a rollout context (and its restore) to a NeMo Gym server."""
    headers = context_headers(context)
    if restore_id is not None:
        headers[RESTORE_HEADER] = str(restore_id)
    return headers


def rollout_cookies(context: RolloutContext, restore_id: int | None = None) -> dict[str, str]:
    """The same as cookies, for hops that forward only cookies (``SimpleAgent``)."""
    cookies = {CAPTURE_KEY_COOKIE: context.capture_key}
    if restore_id is not None:
        cookies[RESTORE_COOKIE] = str(restore_id)
    return cookies


def restore_id_of(headers: Mapping[str, str]) -> int | None:
    """The restore a request's replacement attempt continues from (None: not a replacement)."""
    value = headers.get(RESTORE_HEADER)
    return int(value) if value else None


def current_gym_session() -> dict[str, Any] | None:
    """NeMo Gym's session (``request.session``: its ``session_id`` keys a server's state) of the
    request being handled under ``GymContextMiddleware``, once NeMo Gym's session middleware set
    it (so from within the app, or when its reply starts); None otherwise."""
    scope = _SCOPE.get()
    session = None if scope is None else scope.get("session")
    return session if isinstance(session, dict) else None


def _cookies(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name != b"cookie":
            continue
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(value.decode("latin-1"))
        except Exception:  # a malformed cookie header carries no context: leave it to the app
            continue
        for key, morsel in jar.items():
            if key.encode() in _COOKIE_HEADERS:
                found[key.encode()] = morsel.value.encode("latin-1")
    return found


class GymContextMiddleware:
    """Pure ASGI middleware in front of a NeMo Gym server's app (outside the SDK's middleware):

    - a context cookie of a request without the matching header becomes that header;
    - a reply to a request with a context sets the context cookies again (``path=/``), so an
      agent that forwards only cookies passes the context on;
    - ``current_gym_session()`` gives NeMo Gym's session of the request.

    ``GET /`` (NeMo Gym's liveness route) goes straight to ``liveness`` when given (the app
    NeMo Gym built, unwrapped), so a readiness poll is never taken for rollout work.
    """

    def __init__(self, app: ASGIApp, *, liveness: ASGIApp | None = None) -> None:
        self.app = app
        self.liveness = liveness

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.liveness is not None and scope["path"] == "/" and scope["method"] == "GET":
            await self.liveness(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", ()))
        present = {name for name, _ in headers}
        context: dict[bytes, bytes] = {}
        for cookie, value in _cookies(headers).items():
            header = _COOKIE_HEADERS[cookie]
            context[cookie] = value
            if header not in present:
                headers.append((header, value))
        for cookie, header in _COOKIE_HEADERS.items():
            for name, value in headers:
                if name == header:
                    context[cookie] = value
        if context:
            scope = {**scope, "headers": headers}
        echo = [
            (b"set-cookie", cookie + b"=" + value + b"; Path=/; SameSite=lax")
            for cookie, value in sorted(context.items())
        ]

        async def echoed(message: Message) -> None:
            if echo and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *echo]}
            await send(message)

        token = _SCOPE.set(scope)
        try:
            await self.app(scope, receive, echoed)
        finally:
            _SCOPE.reset(token)
