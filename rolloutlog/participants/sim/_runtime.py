"""What every simulated participant server shares: its settings, transport, registration, the
hold points a test parks episodes at, and the ``/sim/*`` control routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rolloutlog.errors import BackendUnavailable, RolloutlogError, UnknownEpisode, UnknownRun
from rolloutlog.participants._asgi import CAPTURE_KEY_HEADER, context_headers
from rolloutlog.participants._participant import Participant, RolloutContext
from rolloutlog.participants._restore import Restores
from rolloutlog.participants._transport import HttpTransport, KafkaTransport, Transport

__all__ = ["RESTORE_HEADER", "Holds", "ServerSettings", "SimServer"]

#: The header that carries the restore a replacement attempt continues from between sim servers.
RESTORE_HEADER = "x-sim-restore-id"


@dataclass
class ServerSettings:
    """One simulated participant process's command-line settings."""

    role: str
    participant_id: str
    service_url: str
    run: str
    port: int
    restore_id: int | None = None
    transport: str = "http"
    log_url: str | None = None
    token: str | None = None
    policy_url: str | None = None
    agent_url: str | None = None
    resources_urls: dict[str, str] = field(default_factory=dict)
    mode: str = "restart_only"
    verify: str = "wait"
    verify_delay_s: float = 0.0
    token_rate: float = 2000.0
    chunk_tokens: int = 16
    policy_version: int = 1
    skip_restore: bool = False


@dataclass
class _Hold:
    point: str
    capture_key: str | None
    after_tokens: int
    remaining: int
    released: asyncio.Event = field(default_factory=asyncio.Event)
    parked: list[dict[str, Any]] = field(default_factory=list)
    reached: asyncio.Event = field(default_factory=asyncio.Event)


class Holds:
    """Named hold points: an armed hold parks the next ``count`` episodes (of ``capture_key``,
    or any) that reach ``point`` until it is released; ``wait`` returns once one is parked.

    Points that generate tokens (``mid_generation``) park only once ``after_tokens`` tokens are
    durable. With nothing armed, ``park`` costs one attribute check.
    """

    def __init__(self) -> None:
        self._holds: list[_Hold] = []

    def arm(
        self, point: str, capture_key: str | None = None, *, after_tokens: int = 0, count: int = 1
    ) -> None:
        self._holds.append(_Hold(point, capture_key, after_tokens, count))

    def _matching(self, point: str, capture_key: str | None) -> list[_Hold]:
        return [
            h
            for h in self._holds
            if h.point == point and (capture_key is None or h.capture_key in (None, capture_key))
        ]

    async def park(self, point: str, capture_key: str, *, tokens: int = 0, **info: Any) -> None:
        if not self._holds:
            return
        for hold in self._holds:
            if (
                hold.point == point
                and hold.capture_key in (None, capture_key)
                and hold.remaining > 0
                and tokens >= hold.after_tokens
            ):
                hold.remaining -= 1
                hold.parked.append({"point": point, "capture_key": capture_key, **info})
                hold.reached.set()
                await hold.released.wait()
                return

    async def wait(self, point: str, capture_key: str | None, timeout_s: float) -> dict[str, Any]:
        """The first episode parked at a matching hold (waits up to ``timeout_s``)."""
        holds = self._matching(point, capture_key)
        if not holds:
            raise LookupError(f"no hold armed at {point!r} for {capture_key!r}")
        waiters = [asyncio.ensure_future(h.reached.wait()) for h in holds]
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        for hold in holds:
            if hold.parked:
                return hold.parked[0]
        raise TimeoutError(f"nothing reached {point!r} within {timeout_s} s")

    def release(self, point: str | None = None, capture_key: str | None = None) -> int:
        """Release (and disarm) the matching holds; returns how many episodes were parked."""
        released = 0
        for hold in list(self._holds):
            if (point is None or hold.point == point) and (
                capture_key is None or hold.capture_key in (None, capture_key)
            ):
                released += len(hold.parked)
                hold.released.set()
                self._holds.remove(hold)
        return released

    def state(self) -> list[dict[str, Any]]:
        return [
            {
                "point": h.point,
                "capture_key": h.capture_key,
                "after_tokens": h.after_tokens,
                "remaining": h.remaining,
                "parked": h.parked,
            }
            for h in self._holds
        ]


def make_transport(settings: ServerSettings) -> Transport:
    if settings.transport == "kafka":
        if not settings.log_url:
            raise ValueError("--transport kafka needs --log-url kafka://…")
        return KafkaTransport(settings.log_url, url=settings.service_url, token=settings.token)
    return HttpTransport(settings.service_url, token=settings.token)


class SimServer:
    """A participant process's plumbing: transport, restores client, an HTTP client for the
    next hop, holds, and the FastAPI app with the ``/sim/*`` routes.

    ``/sim/ready`` answers 200 once the participant registered (its epoch in the body);
    ``/sim/stats`` returns ``stats()``; ``/sim/holds`` (POST ``{"point", "capture_key"?,
    "after_tokens"?, "count"?}``) arms a hold, ``/sim/holds/wait`` (GET ``?point=&capture_key=
    &timeout_s=``) waits until an episode parks there, ``/sim/holds/release`` (POST) releases.
    """

    def __init__(self, settings: ServerSettings, participant: Callable[[Transport], Participant]):
        self.settings = settings
        self.transport = make_transport(settings)
        self.participant = participant(self.transport)
        # The service's uvicorn drops idle connections after 5 s, httpx after 5 s too: expire
        # ours sooner so no request races the server closing its connection.
        self.service_client = httpx.AsyncClient(
            timeout=60.0, limits=httpx.Limits(keepalive_expiry=2.0)
        )
        self.restores = Restores(
            settings.service_url, token=settings.token, client=self.service_client
        )
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500),
        )
        self.holds = Holds()
        self.ready = False
        self.stats: Callable[[], dict[str, Any]] = lambda: {}
        self.on_start: list[Callable[[], Any]] = []
        self.app = FastAPI(lifespan=self._lifespan)
        self._routes()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.transport.start()
        await self._register()
        for hook in self.on_start:
            result = hook()
            if asyncio.iscoroutine(result):
                await result
        self.ready = True
        try:
            yield
        finally:
            self.holds.release()
            await self.client.aclose()
            await self.restores.close()
            await self.service_client.aclose()
            with contextlib.suppress(Exception):
                await self.transport.stop()

    async def _register(self, timeout_s: float = 120.0) -> None:
        # The launcher starts participants beside the service (their imports overlap its
        # start): wait for the service and the run to exist.
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await self.participant.register()
                return
            except (BackendUnavailable, UnknownRun):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def restore_id(self, request: Request | None = None, body: Any = None) -> int | None:
        """The restore a replacement attempt continues from: the request's (body or header),
        else the one this process was started with."""
        if isinstance(body, dict) and body.get("restore_id") is not None:
            return int(body["restore_id"])
        if request is not None and request.headers.get(RESTORE_HEADER):
            return int(request.headers[RESTORE_HEADER])
        return self.settings.restore_id

    async def projection(self, episode: str, restore_id: int | None) -> dict[str, Any] | None:
        """One episode's projection of a restore (None when the restore did not continue it)."""
        if restore_id is None:
            return None
        try:
            return await self.restores.fetch(self.settings.run, episode, restore_id)
        except UnknownEpisode:
            return None

    async def post(
        self, url: str, path: str, context: RolloutContext, body: Any, restore_id: int | None
    ) -> httpx.Response:
        """A request to the next hop carrying the rollout context (and the restore id)."""
        headers = context_headers(context)
        if restore_id is not None:
            headers[RESTORE_HEADER] = str(restore_id)
        response = await self.client.post(url + path, json=body, headers=headers)
        if response.status_code >= 400:
            raise _Downstream(response)
        return response

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(RolloutlogError)
        async def rolloutlog_error(request: Request, error: RolloutlogError) -> JSONResponse:
            return JSONResponse(error.to_dict(), status_code=error.http_status)

        @app.exception_handler(_Downstream)
        async def downstream(request: Request, error: _Downstream) -> JSONResponse:
            body = {"error": {"code": "downstream", "message": error.response.text[:500]}}
            return JSONResponse(body, status_code=502)

        @app.get("/sim/ready")
        async def ready() -> JSONResponse:
            body = {"ready": self.ready, "epoch": self.participant.epoch}
            return JSONResponse(body, status_code=200 if self.ready else 503)

        @app.get("/sim/stats")
        async def stats() -> dict[str, Any]:
            return {
                "role": self.settings.role,
                "participant": self.participant.id,
                "epoch": self.participant.epoch,
                "holds": self.holds.state(),
                **self.stats(),
            }

        @app.post("/sim/holds")
        async def arm(body: dict[str, Any]) -> dict[str, Any]:
            self.holds.arm(
                str(body["point"]),
                body.get("capture_key"),
                after_tokens=int(body.get("after_tokens", 0)),
                count=int(body.get("count", 1)),
            )
            return {"armed": body["point"]}

        @app.get("/sim/holds/wait")
        async def wait(
            point: str, capture_key: str | None = None, timeout_s: float = 60.0
        ) -> JSONResponse:
            try:
                parked = await self.holds.wait(point, capture_key, timeout_s)
            except LookupError as e:
                return JSONResponse({"error": {"code": "no_hold", "message": str(e)}}, 404)
            except TimeoutError as e:
                return JSONResponse({"error": {"code": "timeout", "message": str(e)}}, 408)
            return JSONResponse(parked)

        @app.post("/sim/holds/release")
        async def release(body: dict[str, Any]) -> dict[str, Any]:
            return {"released": self.holds.release(body.get("point"), body.get("capture_key"))}


class _Downstream(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"{response.request.url}: {response.status_code}")
        self.response = response


def request_context(request: Request) -> RolloutContext:
    """The rollout context of a sim request (its ``x-rolloutlog-capture-key`` header)."""
    key = request.headers.get(CAPTURE_KEY_HEADER)
    if key is None:
        raise ValueError(f"a rollout request needs the {CAPTURE_KEY_HEADER} header")
    return RolloutContext.of(key)
