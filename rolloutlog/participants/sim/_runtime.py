"""What every simulated participant server shares: its settings, transport, registration, the
hold points a test parks episodes at, and the ``/sim/*`` control routes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from rolloutlog.errors import RolloutlogError
from rolloutlog.participants._asgi import (
    CAPTURE_KEY_HEADER,
    RolloutContextMiddleware,
    context_headers,
)
from rolloutlog.participants._participant import Participant, RolloutContext
from rolloutlog.participants._restore import Restores
from rolloutlog.participants._transport import HttpTransport, KafkaTransport, Transport
from rolloutlog.wire import CLIENT_KEEPALIVE_S

__all__ = [
    "RESTORE_HEADER",
    "RUN_HEADER",
    "Holds",
    "ServerSettings",
    "SimServer",
    "serve",
    "supervise",
]

#: The header that carries the restore a replacement attempt continues from between sim servers.
RESTORE_HEADER = "x-sim-restore-id"
#: The header that carries the run a rollout belongs to between sim servers (a process serves
#: its own run and, for the fork demo, any other run a request names: a fork beside it).
RUN_HEADER = "x-sim-run"


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
    #: the policy server's address, or one per worker (calls go round robin by call index, as a
    #: load balancer in front of the workers would spread them)
    policy_urls: list[str] = field(default_factory=list)
    agent_url: str | None = None
    resources_urls: dict[str, str] = field(default_factory=dict)
    mode: str = "restart_only"
    verify: str = "wait"
    verify_delay_s: float = 0.0
    token_rate: float = 2000.0
    chunk_tokens: int = 16
    policy_version: int = 1
    #: The policy version this process serves in any run other than ``run`` (a fork beside it;
    #: None: ``policy_version`` there too).
    fork_policy_version: int | None = None
    skip_restore: bool = False
    #: worker processes (policy only): each serves ``port`` (SO_REUSEPORT) and its own
    #: ``worker_ports[i]`` (control routes, and the address a round-robin client uses)
    workers: int = 1
    worker_index: int | None = None
    worker_ports: list[int] = field(default_factory=list)
    ledger_path: str | None = None
    #: refuse rollout requests without a ``x-rolloutlog-capture-key`` (``/sim/*`` exempt)
    rollout_id_required: bool = True

    @property
    def worker_name(self) -> str:
        return "w0" if self.worker_index is None else f"w{self.worker_index}"


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

    def __init__(
        self, settings: ServerSettings, participant: Callable[[Transport, str], Participant]
    ):
        self.settings = settings
        self.transport = make_transport(settings)
        self._make = participant
        self.participant = participant(self.transport, settings.run)
        #: The participant of each run this process serves (its own run's is ``participant``;
        #: another run's registers in that run when a request first names it).
        self.runs: dict[str, Participant] = {settings.run: self.participant}
        self._joining: dict[str, asyncio.Lock] = {}
        # Idle connections expire before the service closes them (``wire.CLIENT_KEEPALIVE_S``).
        self.service_client = httpx.AsyncClient(
            timeout=60.0, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
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
        self.app.add_middleware(
            RolloutContextMiddleware,
            # the environment is the entry point: the trainer names the attempt in the body
            rollout_id_required=settings.rollout_id_required and settings.role != "environment",
            exempt=("/sim/",),
        )

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
        await self.participant.register(wait_s=timeout_s)

    def run_of(self, request: Request | None = None, body: Any = None) -> str:
        """The run a rollout request belongs to: the body's ``run``, else the ``x-sim-run``
        header, else this process's run."""
        if isinstance(body, dict) and body.get("run"):
            return str(body["run"])
        if request is not None and request.headers.get(RUN_HEADER):
            return str(request.headers[RUN_HEADER])
        return self.settings.run

    async def participant_in(self, run: str) -> Participant:
        """This process's participant in ``run``, registered there on first use (a fork's
        participants register in the fork: their epochs are the fork's)."""
        found = self.runs.get(run)
        if found is not None:
            return found
        lock = self._joining.setdefault(run, asyncio.Lock())
        async with lock:
            if run not in self.runs:
                joined = self._make(self.transport, run)
                await joined.register(wait_s=30.0)
                self.runs[run] = joined
        return self.runs[run]

    def restore_id(self, request: Request | None = None, body: Any = None) -> int | None:
        """The restore a replacement attempt continues from: the request's (body or header),
        else the one this process was started with."""
        if isinstance(body, dict) and body.get("restore_id") is not None:
            return int(body["restore_id"])
        if request is not None and request.headers.get(RESTORE_HEADER):
            return int(request.headers[RESTORE_HEADER])
        return self.settings.restore_id

    async def projection(
        self, episode: str, restore_id: int | None, run: str | None = None
    ) -> dict[str, Any] | None:
        """One episode's projection of a restore of ``run`` (this process's by default; None
        when the restore did not continue it)."""
        if restore_id is None:
            return None
        return await self.restores.continued(
            run or self.settings.run, episode, restore_id, deadline_s=self.transport.deadline_s
        )

    async def post(
        self,
        url: str,
        path: str,
        context: RolloutContext,
        body: Any,
        restore_id: int | None,
        run: str | None = None,
    ) -> httpx.Response:
        """A request to the next hop carrying the rollout context (the restore id, the run)."""
        headers = context_headers(context)
        if restore_id is not None:
            headers[RESTORE_HEADER] = str(restore_id)
        if run is not None and run != self.settings.run:
            headers[RUN_HEADER] = run
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
                "appends_retried": self.transport.stats.retries,
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


def serve(app: ASGIApp, settings: ServerSettings) -> None:
    """Run one server process under uvicorn on ``settings.port``; a worker of a multi-worker
    server shares that port with its siblings (SO_REUSEPORT: the kernel spreads connections)
    and also serves its own ``worker_ports[i]``."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=settings.port,
        log_level="warning",
        access_log=False,
        # well past httpx's 5 s keep-alive expiry: the client drops an idle connection before
        # the server does, so a request never races the server closing it (a ReadError)
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
    )
    index = settings.worker_index
    if index is None:
        uvicorn.Server(config).run()
        return
    sockets = [_bind(settings.port, reuse_port=True)]
    if index < len(settings.worker_ports):
        sockets.append(_bind(settings.worker_ports[index], reuse_port=False))
    uvicorn.Server(config).run(sockets=sockets)


def _bind(port: int, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.set_inheritable(True)
    return sock


def supervise(argv: Sequence[str], settings: ServerSettings) -> int:
    """The parent of a multi-worker server: starts ``settings.workers`` worker processes (this
    command again, with ``--worker-index i`` and the ledger file this incarnation's workers
    share), passes SIGTERM/SIGINT on, and exits when any worker does (stopping the rest)."""
    from rolloutlog.participants._ledger import SharedLedger
    from rolloutlog.participants.sim._gym import die_with_parent

    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    with tempfile.TemporaryDirectory(prefix="rolloutlog-workers-") as tmp:
        ledger = os.path.join(tmp, "ledger.sqlite")
        SharedLedger(ledger, "supervisor").close()  # the schema, before the workers race to it
        procs: list[subprocess.Popen[bytes]] = []
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        for index in range(settings.workers):
            args = [*argv, "--worker-index", str(index), "--ledger-path", ledger]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rolloutlog.participants.sim", *args],
                    preexec_fn=die_with_parent,
                )
            )
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.1)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        codes = [proc.returncode for proc in procs]
    return 0 if stopping else next((c for c in codes if c), 0)
