"""Stand-ins for NeMo Gym's servers in process (no NeMo Gym import): a resources server whose
sessions work as ``SimpleResourcesServer.setup_webserver()``'s do (a ``session_id`` in
``scope["session"]`` from a cookie, set again on every reply: Starlette's ``SessionMiddleware``
without the signing), and an agent whose ``/run`` answers a row's reward."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "CounterServer___counter"


class Sessions:
    """``scope["session"] = {"session_id": ...}`` from the session cookie (a new id without one),
    and the cookie set on every reply."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cookies = Request(scope).cookies
        session_id = cookies.get(SESSION_COOKIE) or str(uuid.uuid4())
        scope["session"] = {"session_id": session_id}

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                cookie = f"{SESSION_COOKIE}={session_id}; Path=/".encode()
                message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
            await send(message)

        await self.app(scope, receive, with_cookie)


def resources_app() -> tuple[FastAPI, dict[str, int]]:
    """A counter keyed by NeMo Gym's session id, as example_session_state_mgmt keeps it."""
    app = FastAPI()
    counters: dict[str, int] = {}
    app.add_middleware(Sessions)

    @app.get("/")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/seed_session")
    async def seed(request: Request) -> dict[str, str]:
        counters.setdefault(request.session["session_id"], 0)  # as NeMo Gym's counter does
        return {}

    @app.post("/increment_counter")
    async def increment(request: Request) -> dict[str, bool]:
        session = request.session["session_id"]
        counters[session] = counters.get(session, 0) + 1
        return {"success": True}

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, float]:
        return {"reward": float(counters.get(request.session["session_id"], 0))}

    @app.post("/aggregate_metrics")
    async def aggregate() -> dict[str, str]:
        return {}

    return app, counters


class FakeAgent:
    """``POST /run``: the row back with ``reward`` = its ``expected`` and a ``response``; the
    rows whose ``expected`` is in ``blocked`` wait until ``release()``, those in ``failing`` get
    a 503; every request's rollout headers are kept (``seen``)."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.blocked: set[float] = set()
        self.waiting: dict[str, asyncio.Event] = {}
        self.released = asyncio.Event()
        self.seen: list[dict[str, str]] = []
        #: rows (by ``expected``) answered 503, as an agent whose resources server died
        self.failing: set[float] = set()
        self.app.post("/run")(self.run)

    async def run(self, request: Request) -> Any:
        row = await request.json()
        if row["expected"] in self.failing:
            return JSONResponse("Hit an exception calling an inner server", status_code=503)
        self.seen.append({k: v for k, v in request.headers.items() if "rolloutlog" in k})
        self.seen[-1]["cookie"] = request.headers.get("cookie", "")
        if row["expected"] in self.blocked:
            self.waiting.setdefault(
                request.headers["x-rolloutlog-capture-key"], asyncio.Event()
            ).set()
            await self.released.wait()
        return {**row, "response": {"output": [], "id": "resp"}, "reward": row["expected"]}

    def release(self) -> None:
        self.released.set()
