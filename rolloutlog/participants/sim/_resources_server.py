"""Simulated resources (tool) servers, one process per mode: ``counter`` (exported), ``verifier``
(stateless) and ``restart`` (restart-only)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp

from rolloutlog.participants._asgi import ResourcesMiddleware
from rolloutlog.participants._participant import RolloutContext
from rolloutlog.participants._sessions import Resources
from rolloutlog.participants.sim._model import expected_answer
from rolloutlog.participants.sim._runtime import ServerSettings, SimServer, request_context

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
    server = SimServer(
        settings,
        lambda t: Resources(
            t,
            settings.run,
            settings.participant_id,
            mode=mode,  # type: ignore[arg-type]
            verify=settings.verify,  # type: ignore[arg-type]
        ),
    )
    resources = server.participant
    assert isinstance(resources, Resources)
    sessions: dict[str, dict[str, Any]] = {}
    restored: dict[str, int | None] = {}
    verifies: list[str] = []
    locks: dict[str, asyncio.Lock] = {}
    server.stats = lambda: {
        "mode": mode,
        "verify": settings.verify,
        "sessions": {k: v["counter"] for k, v in sessions.items()},
        "restored": restored,
        "verifies": verifies,
    }
    app = server.app

    def session_id(context: RolloutContext) -> str:
        return f"{resources.id}:{context.episode}"

    async def session(request: Request, context: RolloutContext) -> dict[str, Any]:
        key = context.capture_key
        if key in sessions:
            return sessions[key]
        lock = locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in sessions:
                state: dict[str, Any] = {"counter": 0}
                if mode == "exported" and context.attempt > 0 and not settings.skip_restore:
                    projection = await server.projection(
                        context.episode, server.restore_id(request)
                    )
                    if projection is not None and projection.get("capture_key") == key:
                        saved = resources.restored_state(projection, session_id(context))
                        if isinstance(saved, dict):
                            state = dict(saved)
                restored[key] = state["counter"] if context.attempt > 0 else None
                sessions[key] = state
        return sessions[key]

    async def state_hook(context: RolloutContext, sid: str) -> Any:
        return sessions.get(context.capture_key, {"counter": 0})

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        context = request_context(request)
        sessions[context.capture_key] = {"counter": 0}
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
        right = response.get("answer") == expected_answer(task)
        result: dict[str, Any] = {"answer_ok": right}
        if mode != "stateless":
            counter = (await session(request, context))["counter"]
            result["counter"] = counter
            right = right and counter == int(task["rounds"])
        verifies.append(context.capture_key)
        return {"reward": 1.0 if right else 0.0, **result}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        context = request_context(request)
        sessions.pop(context.capture_key, None)
        return {"closed": session_id(context)}

    hook = state_hook if mode == "exported" else None
    return server, ResourcesMiddleware(app, resources, state=hook)
