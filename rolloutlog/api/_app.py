"""The app factory: routes, the one error handler, the body limit, the lifespan, operations."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.telemetry import TelemetryConfig
from starlette.exceptions import HTTPException

from rolloutlog._telemetry import configure_tracing, flush_tracing, tracer_provider
from rolloutlog.api import (
    _append,
    _checkpoints,
    _history,
    _openapi,
    _quarantine,
    _results,
    _runs,
    _ui,
)
from rolloutlog.api._auth import ANALYST, PUBLIC, Role, access_if_any, runs_of
from rolloutlog.api._bodies import BODY_METER, BodyMeter
from rolloutlog.api._exports import router as exports_router
from rolloutlog.api._http import json_response, send_error
from rolloutlog.api._metrics import CONTENT_TYPE_LATEST
from rolloutlog.api._models import Health
from rolloutlog.api._observe import Observe
from rolloutlog.api._service import Service
from rolloutlog.api._settings import Settings
from rolloutlog.api._tokens import EVERY_RUN
from rolloutlog.errors import PayloadTooLarge, RequestTimeout, RolloutlogError
from rolloutlog.projections import RunHealthReport

__all__ = ["PUBLIC_PATHS", "create_app", "route_roles"]

logger = logging.getLogger("rolloutlog.api")

#: Routes that are not API routes (the schema; the static assets of the API documents and of the
#: dashboard), open like the health checks.
PUBLIC_PATHS = frozenset({"/openapi.json", _openapi.DOCS_ASSETS, _ui.UI_ASSETS})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The variable that installs the fault tests' routes (``_test_hooks``).
TEST_HOOKS_VARIABLE = "ROLLOUTLOG_TEST_HOOKS"

#: How long /readyz waits for the log's and the catalog's probe each: a stalled backend answers
#: nothing (the catalog's own statement bound is 30 s by default), and a probe must answer sooner.
READY_PROBE_S = 2.0

_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``: an ``HTTPException`` so that FastAPI's body parsing lets it
    through (it turns other exceptions into a generic 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")
        self.limit = limit


class _BodyTimeout(HTTPException):
    """Raised from ``receive`` when a body stalls or trickles (an ``HTTPException``, as
    ``_BodyTooLarge``)."""

    def __init__(self, message: str, timeout_s: float, **details: Any) -> None:
        super().__init__(408, message)
        self.timeout_s = timeout_s
        self.details = details


class BodyTimeout:
    """Refuses a request whose body stalls or trickles, answering ``408 request_timeout`` and
    closing its connection (uvicorn times out idle keep-alive connections only; headers are
    timed by ``_protocol``):

    - every ``receive`` of a body not yet complete must return within ``timeout_s``;
    - with ``min_rate`` (bytes a second; 0: none), the time spent waiting for the body may not
      pass ``timeout_s`` plus one second per ``min_rate`` bytes received: past a grace of
      ``timeout_s``, the body must average ``min_rate``. A body sent a byte every few seconds
      never stalls, and without this held its append slot for good. Only the time ``receive``
      waits counts: a slow app does not make its client slow;
    - the body's ``BodyMeter`` (in the scope) lets an append that finds every slot taken take
      this one's when it is slowest and below ``min_rate`` (``_bodies``): its wait is then
      refused the same way, at once.

    Once the body is complete, ``receive`` is left alone: a streaming response waits on it for
    the disconnect."""

    def __init__(self, app: ASGIApp, timeout_s: float, min_rate: int = 0) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        complete = False
        timeout_s = self.timeout_s
        min_rate = self.min_rate
        meter = scope[BODY_METER] = BodyMeter()
        loop = asyncio.get_running_loop()

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            wait_s = timeout_s
            if min_rate:
                wait_s = min(wait_s, timeout_s + meter.received / min_rate - meter.waited)
            task = asyncio.current_task()
            meter.start(loop.time(), task)
            try:
                async with asyncio.timeout(max(wait_s, 0.0)):
                    message = await receive()
            except (TimeoutError, asyncio.CancelledError) as e:
                meter.stop(loop.time())
                if not meter.evicted:
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    if wait_s >= timeout_s:
                        text = f"no part of the request body arrived for {timeout_s:g} s"
                        raise _BodyTimeout(text, timeout_s) from None
                elif task is not None and task.cancelling():
                    task.uncancel()  # its slot went to another append: refused, not cancelled
                raise _BodyTimeout(
                    f"the request body arrived at {meter.received / meter.waited:.0f} bytes/s "
                    f"over {meter.waited:.1f} s, below the minimum of {min_rate} bytes/s"
                    + (
                        "; its append slot went to another append"
                        if meter.evicted
                        else f" (after the first {timeout_s:g} s)"
                    ),
                    timeout_s,
                    min_body_rate=min_rate,
                    received_bytes=meter.received,
                ) from None
            meter.stop(loop.time())
            if message["type"] != "http.request":
                complete = True
            else:
                meter.received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, timed, send)


class BodyLimit:
    """Bounds every request body without buffering it: a declared ``Content-Length`` over the
    limit is refused before anything is read, and a streamed body is cut off at the limit."""

    def __init__(self, app: ASGIApp, events_limit: int, other_limit: int) -> None:
        self.app = app
        self.events_limit = events_limit
        self.other_limit = other_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        limit = self.events_limit if path.endswith("/events") else self.other_limit
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit or declared < 0:
                    error = PayloadTooLarge(
                        f"the request body is {value.decode(errors='replace')} bytes; this route "
                        f"accepts at most {limit}",
                        max_bytes=limit,
                    )
                    service = getattr(getattr(scope.get("app"), "state", None), "service", None)
                    if service is not None:
                        service.metrics.refusals.labels(error.code).inc()
                    await send_error(send, error, close=True)
                    return
                break
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


def _error_response(request: Request, error: RolloutlogError) -> Response:
    service: Service | None = getattr(request.app.state, "service", None)
    if service is not None:
        service.metrics.refusals.labels(error.code).inc()
    headers: dict[str, str] = {}
    if error.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif error.http_status == 408:
        headers["Connection"] = "close"  # the rest of the body may never come
    retry_after = error.details.get("retry_after_s")
    if isinstance(retry_after, int):
        headers["Retry-After"] = str(retry_after)
    elif error.http_status >= 500:
        logger.error("request failed: %s", error.message, extra={"code": error.code})
    return json_response(error.to_dict(), error.http_status, headers=headers or None)


def _install_error_handlers(app: FastAPI) -> None:
    async def rolloutlog_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RolloutlogError)
        return _error_response(request, exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = [
            {
                "field": ".".join(str(part) for part in error.get("loc", ())),
                "reason": str(error.get("msg", "")),
                "type": str(error.get("type", "")),
            }
            for error in exc.errors()
        ]
        first = problems[0] if problems else {"field": "(request)", "reason": "invalid"}
        error = _StatusError(
            400,
            "invalid_request",
            f"invalid {first['field']}: {first['reason']}",
            field=first["field"],
            problems=problems[:20],
        )
        return _error_response(request, error)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if isinstance(exc, _BodyTooLarge):
            error: RolloutlogError = PayloadTooLarge(
                f"the request body exceeds {exc.limit} bytes", max_bytes=exc.limit
            )
        elif isinstance(exc, _BodyTimeout):
            error = RequestTimeout(str(exc.detail), timeout_s=exc.timeout_s, **exc.details)
        else:
            code = _HTTP_CODES.get(exc.status_code, "invalid_request")
            message = str(exc.detail) if exc.detail else code
            if exc.status_code == 404:
                message = f"no route {request.method} {request.url.path}"
            error = _StatusError(exc.status_code, code, message)
        return _error_response(request, error)

    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = _StatusError(500, "internal", "internal error (see the service's log)")
        return _error_response(request, error)

    app.add_exception_handler(RolloutlogError, rolloutlog_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


class _StatusError(RolloutlogError):
    """An error whose code and status are decided at run time (HTTP-level refusals)."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message, **details)
        self.http_status = status  # type: ignore[misc]
        self.code = code  # type: ignore[misc]


def _ops_routes(app: FastAPI) -> None:
    @app.get("/healthz", summary="Liveness", response_model=Health, dependencies=PUBLIC)
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get(
        "/readyz",
        summary="Readiness: the log and the catalog are reachable, every run's projector is ok",
        response_model=Health,
        dependencies=PUBLIC,
        responses={503: {"model": Health}},
    )
    async def readyz(request: Request) -> Response:
        service: Service = request.app.state.service
        coordinator = service.coordinator
        probes: dict[str, Callable[[], Awaitable[object]]] = {
            "log": service.log.ping,
            "catalog": lambda: service.catalog.list_runs(limit=1),
            # What holds each run back on any replica (for the body only: see below).
            "cluster": coordinator.runs_health,
        }

        async def probe(name: str) -> tuple[object, str]:
            """The probe's answer and ``ok``, or None and what went wrong."""
            try:
                async with asyncio.timeout(READY_PROBE_S):
                    return await probes[name](), "ok"
            except TimeoutError:
                return None, f"no answer within {READY_PROBE_S:g} s"
            except Exception as e:  # any failure means "not ready"; the reason is reported
                return None, f"{type(e).__name__}: {e}"

        found = dict(zip(probes, await asyncio.gather(*map(probe, probes)), strict=True))
        checks = {name: found[name][1] for name in ("log", "catalog")}
        cluster, cluster_check = found["cluster"]
        if cluster_check != "ok":  # reported, but this replica's readiness is its own
            checks["cluster"] = cluster_check
        if service.draining:
            checks["service"] = "shutting down"
        # A run whose projector here cannot make progress makes this service unready (its
        # checkpoints cannot commit); the body says, per run, what holds it back on any replica
        # (the status code stays this replica's own: load balancers route by it).
        local = coordinator.health()
        reports = cast("dict[str, RunHealthReport] | None", cluster) or {}
        runs = {run: report.view(coordinator.replica_id) for run, report in reports.items()}
        for run, health in local.items():
            runs.setdefault(run, {**health.view(), "local": health.view(), "held_back": []})
        if request.app.state.settings.metrics_auth:  # runs named only to who may read them
            shown = (await access_if_any(request)).runs_for(Role.ANALYST)
            runs = {run: view for run, view in runs.items() if shown.covers(run)}
        ready = all(value == "ok" for name, value in checks.items() if name != "cluster") and all(
            health.status == "ok" for health in local.values()
        )
        return json_response(
            {
                "status": "ready" if ready else "unready",
                "replica": coordinator.replica_id,
                "log": checks["log"],
                "catalog": checks["catalog"],
                "runs": dict(sorted(runs.items())),
                "checks": checks,
            },
            200 if ready else 503,
        )

    if os.environ.get(TEST_HOOKS_VARIABLE) == "1":
        _test_hooks(app)

    # ``--metrics-auth``: /metrics is the analyst's (each token sees its runs' series only).
    guarded = app.state.settings.metrics_auth

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        dependencies=ANALYST if guarded else PUBLIC,
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def metrics(request: Request) -> Response:
        service: Service = request.app.state.service
        await service.metrics.refresh()
        scope = await runs_of(request, Role.ANALYST) if guarded else EVERY_RUN
        return Response(service.metrics.exposition(scope), media_type=CONTENT_TYPE_LATEST)


def _test_hooks(app: FastAPI) -> None:
    """Routes for fault tests only, installed when ``ROLLOUTLOG_TEST_HOOKS=1`` (never in a
    deployment): ``POST /_test/block-loop?seconds=S`` keeps the service's event loop busy for S
    seconds (a blocking call on the loop, as a long fold would), so a test can show that the
    lease heartbeat goes on and that the other replicas name the busy one."""

    @app.post("/_test/block-loop", include_in_schema=False, dependencies=PUBLIC)
    async def block_loop(seconds: float = 1.0) -> Response:
        until = time.monotonic() + min(max(seconds, 0.0), 600.0)
        while time.monotonic() < until:  # busy on purpose: nothing else runs on this loop
            time.sleep(0.01)  # noqa: ASYNC251
        return json_response({"blocked_s": seconds})


def create_app(settings: Settings | None = None) -> FastAPI:
    """The rolloutlog service as an ASGI app; its lifespan opens and closes the backends."""
    settings = settings or Settings()
    # FastAPI's own telemetry makes the server spans (the caller's traceparent, the route
    # template); off entirely while nothing records spans, which also spares it looking up three
    # providers per request.
    telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    if configure_tracing():  # from the OTEL_* variables
        telemetry = {"tracer_provider": tracer_provider(), "operation_spans": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings)
        await service.start()
        app.state.service = service
        try:
            yield
        finally:
            await service.stop()
            flush_tracing()

    app = FastAPI(
        title="rolloutlog",
        version="0.1.0",
        summary="Event-sourced checkpoint log for reinforcement-learning rollouts",
        lifespan=lifespan,
        telemetry=telemetry,
        docs_url=None,  # served from local files by _openapi.install_docs
        redoc_url=None,
    )
    app.state.tokens = settings.tokens
    app.state.settings = settings
    _install_error_handlers(app)
    _ops_routes(app)
    # The routers' routes join the app's own table as they are (no prefix, no extra
    # dependencies), so that ``app.routes`` lists every route for ``route_roles``.
    app.router.routes.extend(exports_router.routes)  # checkpoint exports' long poll
    for module in (_runs, _append, _checkpoints, _quarantine):
        app.router.routes.extend(module.router.routes)
    app.router.routes.extend(_history.router.routes)
    app.router.routes.extend(_results.router.routes)
    _openapi.install_docs(app)
    _ui.install_ui(app)
    _openapi.document(app)
    app.add_middleware(
        BodyLimit,
        events_limit=settings.max_events_bytes,
        other_limit=settings.max_request_bytes,
    )
    app.add_middleware(
        BodyTimeout, timeout_s=settings.body_timeout_s, min_rate=settings.min_body_rate
    )
    # Outermost of ours: it times and logs every request, refused ones included.
    app.add_middleware(Observe, observe=_observe_request)
    return app


def _observe_request(scope: Scope, method: str, route: str, status: int, seconds: float) -> None:
    service: Service | None = getattr(getattr(scope.get("app"), "state", None), "service", None)
    if service is not None:
        service.metrics.observe_request(method, route, status, seconds)


def route_roles(app: FastAPI) -> dict[tuple[str, str], Role | None]:
    """(method, path) → the role each API route declares (``None``: public).

    Raises ``LookupError`` for a route that declares no role, or more than one.
    """
    table: dict[tuple[str, str], Role | None] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        declared = [
            dep.call.role  # type: ignore[union-attr]
            for dep in route.dependant.dependencies
            if hasattr(dep.call, "role")
        ]
        if len(declared) != 1:
            raise LookupError(f"route {route.path} declares {len(declared)} roles, not one")
        for method in route.methods or ():
            table[(method, route.path)] = declared[0]
    return table
