"""What every request leaves behind: its request id, its duration in the per-route histogram, and
one access-log line (the server span is FastAPI's own: ``create_app``)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rolloutlog import _telemetry
from rolloutlog.api._logging import audit
from rolloutlog.errors import RolloutlogError

if TYPE_CHECKING:
    from prometheus_client import Histogram
    from starlette.requests import Request

    from rolloutlog.api._metrics import Metrics

__all__ = ["REQUEST_ID", "Audited", "Observe", "request_id", "route_of", "who"]

access_logger = logging.getLogger("rolloutlog.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID = "X-Request-ID"
_REQUEST_ID = b"x-request-id"
_TRACEPARENT = b"traceparent"
#: A route label for requests no route matched (404s): one series, not one per path.
UNMATCHED = "(unmatched)"


def _acceptable(value: bytes) -> bool:
    # A caller's id is echoed in a header and a log line: short and printable only.
    return 0 < len(value) <= 128 and all(0x21 <= byte <= 0x7E for byte in value)


def route_of(scope: Scope) -> str:
    """The template of the route that served a request (``/v1/runs/{run}/events``): FastAPI's
    routes name themselves in the scope; plain Starlette routes and mounts (the schema, static
    assets) are found by the endpoint they matched."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    endpoint = scope.get("endpoint")
    app = scope.get("app")
    if endpoint is None or app is None:
        return UNMATCHED
    for candidate in getattr(app, "routes", ()):
        if getattr(candidate, "endpoint", None) is endpoint:
            return str(candidate.path)
        if getattr(candidate, "app", None) is endpoint:  # a mount
            return f"{candidate.path}/{{path}}"
    return UNMATCHED


def request_id(scope: Scope) -> str | None:
    """The id of the request being served (as the middleware set it)."""
    state = scope.get("state")
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def _trace_id_of(traceparent: bytes | None) -> str | None:
    # W3C: version-traceid-parentid-flags; logged even while the service records no spans, so
    # that the caller's trace can be found in the service's log.
    if traceparent is None or len(traceparent) < 55 or traceparent[2:3] != b"-":
        return None
    trace_id = traceparent[3:35].decode("latin-1")
    return trace_id if trace_id.strip("0") and trace_id.isalnum() else None


class Observe:
    """ASGI middleware: ``X-Request-ID`` (the caller's, else a new one) on the response, in the
    scope's state and on the server span, the request's duration by method, route and status
    (``observe(scope, method, route, status, seconds)``), and an access-log line
    (``rolloutlog.access`` at INFO)."""

    def __init__(
        self, app: ASGIApp, observe: Callable[[Scope, str, str, int, float], None]
    ) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given: bytes | None = None
        traceparent: bytes | None = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                given = value
            elif name == _TRACEPARENT:
                traceparent = value
        rid = given if given is not None and _acceptable(given) else os.urandom(8).hex().encode()
        rid_text = rid.decode("ascii")
        state = scope.setdefault("state", {})
        state["request_id"] = rid_text
        status = 500

        async def stamped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (_REQUEST_ID, rid)]
            await send(message)

        method: str = scope["method"]
        # FastAPI's own telemetry opened the server span (parented to the caller's
        # traceparent) around this middleware, when tracing is on.
        trace_id = _telemetry.current_trace_id()
        if trace_id is not None:
            _telemetry.set_attributes({"rolloutlog.request_id": rid_text})
        try:
            await self.app(scope, receive, stamped)
        finally:
            seconds = time.perf_counter() - started
            route = route_of(scope)
            self.observe(scope, method, route, status, seconds)
            if access_logger.isEnabledFor(logging.INFO):
                client = scope.get("client")
                access_logger.info(
                    "%s %s %d",
                    method,
                    route,
                    status,
                    extra={
                        "method": method,
                        "route": route,
                        "path": scope["path"],
                        "status": status,
                        "duration_ms": round(seconds * 1000, 3),
                        "request_id": rid_text,
                        "trace_id": trace_id or _trace_id_of(traceparent),
                        "client": client[0] if client else None,
                    },
                )


def who(request: Request) -> dict[str, Any]:
    """Who made a request, for the audit log: the roles its bearer token holds and a
    fingerprint of the token (never the token), or the loopback client when tokens are off."""
    client = request.client.host if request.client is not None else None
    tokens = request.app.state.tokens
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not tokens.enabled or not token:
        return {"client": client}
    roles = sorted(role.value for role in tokens.roles_of(token))
    fingerprint = hashlib.sha256(token.encode()).hexdigest()[:12]
    return {"roles": roles, "token": fingerprint, "client": client}


class Audited:
    """A checkpoint or restore request: its span (``rolloutlog.<action>``, the stages' parent),
    its durations by stage and outcome, and its audit line. ``done`` names the outcome; an
    exception's code is the outcome otherwise (its total duration is observed then)."""

    def __init__(self, request: Request, action: str, histogram: Histogram, **what: Any) -> None:
        self.request = request
        self.action = action
        self.histogram = histogram
        self.what = what
        self.outcome = "internal"
        self.timings_ms: Mapping[str, float] | None = None
        self._span = _telemetry.span(
            f"rolloutlog.{action}",
            {f"rolloutlog.{k}": v for k, v in what.items() if isinstance(v, str | int)},
        )

    def __enter__(self) -> Audited:
        self.started = time.perf_counter()
        self._span.__enter__()
        return self

    def done(
        self, outcome: str, timings_ms: Mapping[str, float] | None = None, **what: Any
    ) -> None:
        self.outcome = outcome
        self.timings_ms = timings_ms
        self.what.update(what)
        _telemetry.set_attributes(
            {
                "rolloutlog.outcome": outcome,
                **{f"rolloutlog.{k}": v for k, v in what.items() if isinstance(v, str | int)},
            }
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        seconds = time.perf_counter() - self.started
        if exc is not None:
            self.outcome = exc.code if isinstance(exc, RolloutlogError) else "internal"
        metrics: Metrics = self.request.app.state.service.metrics
        if self.timings_ms is not None:
            metrics.stages(self.histogram, self.timings_ms, self.outcome)
        else:
            self.histogram.labels("total", self.outcome).observe(seconds)
        try:
            audit(
                self.action,
                self.outcome,
                seconds,
                who(self.request),
                request_id=request_id(self.request.scope),
                trace_id=_telemetry.current_trace_id(),
                **self.what,
            )
        finally:
            self._span.__exit__(exc_type, exc, tb)
