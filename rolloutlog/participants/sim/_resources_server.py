"""Simulated resources (tool) servers, one process per mode: ``counter`` (exported), ``verifier``
(stateless), ``restart`` (restart-only) and ``sandbox`` (export-on-checkpoint: its counters live
in a SQLite file of its own, outside the process, and are snapshotted when a checkpoint asks)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import os
import sqlite3
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Scope

from rolloutlog.errors import InvalidRequest
from rolloutlog.participants._asgi import ResourcesMiddleware
from rolloutlog.participants._participant import RolloutContext
from rolloutlog.participants._sessions import Resources, SessionKey
from rolloutlog.participants.sim._model import verdict
from rolloutlog.participants.sim._runtime import (
    RUN_HEADER,
    ServerSettings,
    SimServer,
    request_context,
)

__all__ = ["resources_server"]


def resources_server(settings: ServerSettings) -> tuple[SimServer, ASGIApp]:
    """A tool server in ``settings.mode`` (``exported``, ``stateless`` or ``restart_only``)
    with verify mode ``settings.verify``; returns the server and its app wrapped in
    ``ResourcesMiddleware`` (session lifecycle recorded before each reply).

    Routes (all POST, under a rollout context): ``/seed_session`` (a fresh session: counter 0),
    ``/tool`` (adds 1 to the session's counter; a stateless server computes a pure function),
    ``/verify`` ``{"task", "response"}`` → ``{"reward"}``: 1.0 when the answer is the task's
    and, on stateful servers, the counter equals the task's rounds; ``/close_session``.

    An ``exported`` server records ``{"counter": n}`` as ``session.state`` before each reply; a
    replacement attempt's session gets the restored state, unless the process runs with
    ``skip_restore`` (the negative control: it starts from 0 and the reward comes out wrong).
    Hold points: ``in_tool``, ``in_verify`` (before the reward is computed). ``/sim/stats``:
    ``sessions`` (capture key → counter), ``restored`` (capture key → restored counter or None),
    ``verifies`` (capture keys in the order verified).
    """
    mode = settings.mode
    if mode == "sandbox":
        return _sandbox_server(settings)
    server = SimServer(
        settings,
        lambda t, run: Resources(
            t,
            run,
            settings.participant_id,
            mode=mode,  # type: ignore[arg-type]
            verify=settings.verify,  # type: ignore[arg-type]
        ),
    )
    own = server.participant
    assert isinstance(own, Resources)
    #: per (run, capture key): the live session; its restored counter; verifies in order
    sessions: dict[tuple[str, str], dict[str, Any]] = {}
    restored: dict[tuple[str, str], int | None] = {}
    verifies: list[tuple[str, str]] = []
    locks: dict[tuple[str, str], asyncio.Lock] = {}

    def shown(key: tuple[str, str]) -> str:
        """This run's capture keys as they are; another run's as ``run/capture key``."""
        return key[1] if key[0] == settings.run else f"{key[0]}/{key[1]}"

    server.stats = lambda: {
        "mode": mode,
        "verify": settings.verify,
        "sessions": {shown(k): v["counter"] for k, v in sessions.items()},
        "restored": {shown(k): v for k, v in restored.items()},
        "verifies": [shown(k) for k in verifies],
    }
    app = server.app
    #: the run of the request being served (set by the middleware's ``resources_for``)
    serving: contextvars.ContextVar[str] = contextvars.ContextVar("serving", default=settings.run)

    async def resources_for(scope: Scope) -> Resources:
        headers = dict(scope.get("headers", ()))
        run = headers.get(RUN_HEADER.encode(), settings.run.encode()).decode("latin-1")
        serving.set(run)
        found = await server.participant_in(run)
        assert isinstance(found, Resources)
        return found

    def session_id(context: RolloutContext) -> str:
        return own.session_id(context)

    async def session(request: Request, context: RolloutContext) -> dict[str, Any]:
        run = server.run_of(request)
        key = (run, context.capture_key)
        if key in sessions:
            return sessions[key]
        lock = locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in sessions:
                state: dict[str, Any] = {"counter": 0}
                if mode == "exported" and context.attempt > 0 and not settings.skip_restore:
                    projection = await server.projection(
                        context.episode, server.restore_id(request), run
                    )
                    if projection is not None and projection.get("capture_key") == key[1]:
                        resources = await server.participant_in(run)
                        assert isinstance(resources, Resources)
                        saved = resources.restored_state(projection, session_id(context))
                        if isinstance(saved, dict):
                            state = dict(saved)
                restored[key] = state["counter"] if context.attempt > 0 else None
                sessions[key] = state
        return sessions[key]

    async def state_hook(context: RolloutContext, sid: str) -> Any:
        return sessions.get((serving.get(), context.capture_key), {"counter": 0})

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        context = request_context(request)
        sessions[(server.run_of(request), context.capture_key)] = {"counter": 0}
        return {"session_id": session_id(context)}

    @app.post("/tool")
    async def tool(request: Request) -> dict[str, Any]:
        context = request_context(request)
        body = await request.json()
        await server.holds.park("in_tool", context.capture_key)
        if mode == "stateless":
            text = f"{context.episode}:{body.get('round')}"
            return {"value": hashlib.sha256(text.encode()).hexdigest()[:8]}
        state = await session(request, context)
        state["counter"] += 1
        return {"counter": state["counter"]}

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, Any]:
        context = request_context(request)
        body = await request.json()
        task, response = body["task"], body["response"]
        await server.holds.park("in_verify", context.capture_key)
        delay = float(task.get("verify_delay_s") or settings.verify_delay_s)
        if delay:
            await asyncio.sleep(delay)
        counter = None if mode == "stateless" else (await session(request, context))["counter"]
        verifies.append((server.run_of(request), context.capture_key))
        return verdict(task, response, counter)

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        context = request_context(request)
        sessions.pop((server.run_of(request), context.capture_key), None)
        return {"closed": session_id(context)}

    hook = state_hook if mode == "exported" else None
    return server, ResourcesMiddleware(app, own, state=hook, resources_for=resources_for)


class SandboxStore:
    """The sandbox's state outside the process: live session counters and snapshots, in a SQLite
    file that survives the process (a stand-in for a container or a remote database)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._connect() as db:
            db.execute("CREATE TABLE IF NOT EXISTS sessions (key TEXT PRIMARY KEY, counter INT)")
            db.execute("CREATE TABLE IF NOT EXISTS snapshots (ref TEXT PRIMARY KEY, counter INT)")

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def _run(self, sql: str, *args: Any) -> int | None:
        with contextlib.closing(self._connect()) as db:
            row = db.execute(sql, args).fetchone()
            return None if row is None else int(row[0])

    async def get(self, key: str) -> int | None:
        return await asyncio.to_thread(self._run, "SELECT counter FROM sessions WHERE key = ?", key)

    async def set(self, key: str, counter: int) -> None:
        sql = "INSERT OR REPLACE INTO sessions (key, counter) VALUES (?, ?)"
        await asyncio.to_thread(self._run, sql, key, counter)

    async def add(self, key: str) -> int:
        sql = "UPDATE sessions SET counter = counter + 1 WHERE key = ? RETURNING counter"
        counter = await asyncio.to_thread(self._run, sql, key)
        assert counter is not None, f"no sandbox session {key}"
        return counter

    async def drop(self, key: str) -> None:
        await asyncio.to_thread(self._run, "DELETE FROM sessions WHERE key = ?", key)

    async def snapshot(self, key: str) -> str | None:
        """Copy a live session's state to a new snapshot; its reference (None: no such session)."""
        counter = await self.get(key)
        if counter is None:
            return None
        ref = f"{key}@{uuid.uuid4().hex[:12]}"
        sql = "INSERT INTO snapshots (ref, counter) VALUES (?, ?)"
        await asyncio.to_thread(self._run, sql, ref, counter)
        return ref

    async def snapshot_counter(self, ref: str) -> int | None:
        sql = "SELECT counter FROM snapshots WHERE ref = ?"
        return await asyncio.to_thread(self._run, sql, ref)


def sandbox_path(settings: ServerSettings) -> Path:
    """Where a sandbox server keeps its state: ``ROLLOUTLOG_SIM_SANDBOX_DIR`` (a ``Gym`` sets its
    data dir's ``sandbox``; default: the temporary directory), one file per service, run and
    participant id, so that a replacement process finds what the killed one exported."""
    root = Path(os.environ.get("ROLLOUTLOG_SIM_SANDBOX_DIR") or tempfile.gettempdir())
    service = hashlib.sha256(settings.service_url.encode()).hexdigest()[:8]
    return root / f"rolloutlog-sandbox-{service}-{settings.run}-{settings.participant_id}.db"


def _sandbox_server(settings: ServerSettings) -> tuple[SimServer, ASGIApp]:
    """``--mode sandbox``: the counter server's routes and reward, its counters kept in
    ``SandboxStore`` and exported on checkpoint (``Resources`` mode ``checkpoint``): a change mark
    before each ``/tool`` reply, a snapshot reference ``{"snapshot", "store"}`` per session when
    a checkpoint asks, restored from on the replacement attempt (unless ``skip_restore``).
    ``/sim/stats``: as the counter server's, plus ``exports``."""
    store = SandboxStore(sandbox_path(settings))

    async def export_hook(sessions: Sequence[SessionKey]) -> Mapping[SessionKey, Any]:
        refs = await asyncio.gather(*(store.snapshot(key) for key, _ in sessions))
        return {
            session: {"snapshot": ref, "store": str(store.path)}
            for session, ref in zip(sessions, refs, strict=True)
            if ref is not None  # a session that is gone is left out: dropped
        }

    server = SimServer(
        settings,
        lambda t, run: Resources(
            t,
            run,
            settings.participant_id,
            mode="checkpoint",
            verify=settings.verify,  # type: ignore[arg-type]
            export_hook=export_hook,
        ),
    )
    resources = server.participant
    assert isinstance(resources, Resources)
    restored: dict[str, int | None] = {}
    verifies: list[str] = []
    live: set[str] = set()
    server.stats = lambda: {
        "mode": "sandbox",
        "verify": settings.verify,
        "sessions": sorted(live),
        "restored": restored,
        "verifies": verifies,
        "exports": resources.exports,
    }
    exporting: list[asyncio.Task[None]] = []  # kept referenced: it runs as long as the process

    def start_exports() -> None:
        exporting.append(asyncio.create_task(resources.serve_exports(server.restores, poll_s=10.0)))

    server.on_start.append(start_exports)
    app = server.app

    session_id = resources.session_id

    def own_run(request: Request) -> None:
        # Its store and exports are its run's: a fork beside it is served by the other modes.
        if server.run_of(request) != settings.run:
            raise InvalidRequest("the sandbox server serves its own run only", field="run")

    async def counter_of(request: Request, context: RolloutContext) -> int:
        """The live counter; a replacement attempt's first request restores it."""
        key = context.capture_key
        counter = await store.get(key)
        if counter is not None:
            return counter
        counter = 0
        if context.attempt > 0 and not settings.skip_restore:
            projection = await server.projection(context.episode, server.restore_id(request))
            if projection is not None and projection.get("capture_key") == key:
                saved = resources.restored_state(projection, session_id(context))
                if isinstance(saved, dict) and saved.get("snapshot"):
                    counter = await store.snapshot_counter(str(saved["snapshot"])) or 0
        restored[key] = counter if context.attempt > 0 else None
        await store.set(key, counter)
        live.add(key)
        return counter

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        own_run(request)
        context = request_context(request)
        await store.set(context.capture_key, 0)
        live.add(context.capture_key)
        return {"session_id": session_id(context)}

    @app.post("/tool")
    async def tool(request: Request) -> dict[str, Any]:
        own_run(request)
        context = request_context(request)
        await server.holds.park("in_tool", context.capture_key)
        sid = session_id(context)
        async with resources.session_lock(context, sid):
            await counter_of(request, context)
            counter = await store.add(context.capture_key)
            await resources.record_state(context, sid, None)  # the change mark, before replying
        return {"counter": counter}

    @app.post("/verify")
    async def verify(request: Request) -> dict[str, Any]:
        context = request_context(request)
        body = await request.json()
        task, response = body["task"], body["response"]
        await server.holds.park("in_verify", context.capture_key)
        counter = await counter_of(request, context)
        verifies.append(context.capture_key)
        return verdict(task, response, counter)

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        context = request_context(request)
        await store.drop(context.capture_key)
        live.discard(context.capture_key)
        return {"closed": session_id(context)}

    return server, ResourcesMiddleware(app, resources)
