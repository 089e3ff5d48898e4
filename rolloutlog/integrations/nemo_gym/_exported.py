"""Exported state: how a stateful NeMo Gym resources server becomes restorable.

A server keeps its state where it keeps it (its own process, keyed by NeMo Gym's session id,
``request.session["session_id"]``) and declares it in its ``rolloutlog:`` dict: ``mode:
exported`` and ``state: "module:factory"``. ``factory(server)`` (the server instance) returns
a ``StateHooks``, three methods over the server's own state, each given NeMo Gym's session id
(plain or ``async``):

- ``export(session_id)``: the session's state as JSON (None: it has none), recorded as
  ``session.state`` before each reply of a rollout request leaves (the write-ahead rule);
- ``restore(session_id, state)``: put a session's state back, on the replacement attempt's
  first request to the server, before the server handles it, under the NeMo Gym session that
  request carries (a replayed ``/seed_session`` opens a new one: the restored state is the one
  the agent continues with);
- ``retire(session_id)``: forget a session: the one a restore superseded (a server that lived
  through the restore still holds it, with changes past the checkpoint), and one that
  ``/close_session`` closed.

``rolloutlog.integrations.nemo_gym.examples.session_counter:CounterState`` is the worked
example (``example_session_state_mgmt``'s counter).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Protocol

from rolloutlog.integrations.nemo_gym._config import GymSettings
from rolloutlog.integrations.nemo_gym._context import current_gym_session, restore_id_of
from rolloutlog.participants import (
    DEFAULT_DEADLINE_S,
    Resources,
    Restores,
    RolloutContext,
    current_context,
)

if TYPE_CHECKING:  # plain ASGI: starlette is not needed to run it
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ExportedState", "SessionState", "StateHooks", "continued_projection"]

#: NeMo Gym's key of its session id in ``request.session`` (``nemo_gym.server_utils``).
GYM_SESSION_ID = "session_id"


class StateHooks(Protocol):
    """What a user writes for a stateful resources server (module docstring)."""

    def export(self, session_id: str) -> Any: ...

    def restore(self, session_id: str, state: Any) -> Any: ...

    def retire(self, session_id: str) -> Any: ...


#: The name ``StateHooks`` had before (the ``session.state`` event's class is ``SessionState``).
SessionState = StateHooks


async def _call(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def continued_projection(
    restores: Restores,
    run: str,
    context: RolloutContext,
    restore_id: int | None,
    *,
    deadline_s: float,
) -> dict[str, Any] | None:
    """The projection a replacement attempt continues from (restore ``restore_id``, else the
    latest); None for attempt 0, or when that restore did not continue this attempt."""
    if context.attempt == 0:
        return None
    restore: int | str = "latest" if restore_id is None else restore_id
    projection = await restores.continued(run, context.episode, restore, deadline_s=deadline_s)
    if projection is None or projection.get("capture_key") != context.capture_key:
        return None
    return projection


class ExportedState:
    """A ``StateHooks`` wired into a resources server's app: ``record`` is the SDK's state
    hook (``ResourcesMiddleware``), ``install`` puts the restoring middleware inside the app."""

    def __init__(
        self,
        state: StateHooks,
        settings: GymSettings,
        resources: Resources,
        restores: Restores | None = None,
    ) -> None:
        self.user = state
        self.settings = settings
        self.resources = resources
        #: where projections come from (a given one is the caller's to close)
        self.owned = restores is None
        self.restores = (
            Restores(settings.url, token=settings.token) if restores is None else restores
        )
        self.deadline_s = float(settings.options.get("deadline_s", DEFAULT_DEADLINE_S))
        #: capture keys of the replacement attempts restored in this process
        self._restored: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    async def record(self, context: RolloutContext, session_id: str) -> dict[str, Any]:
        """The state recorded before a reply: NeMo Gym's session id and the user's export."""
        gym = current_gym_session() or {}
        gym_id = gym.get(GYM_SESSION_ID)
        exported = None if gym_id is None else await _call(self.user.export(str(gym_id)))
        return {"gym_session": gym_id, "state": exported}

    def install(self, app: Any) -> None:
        """Add the restoring middleware innermost in ``app`` (a Starlette/FastAPI app whose
        middleware stack is not built yet): it runs after NeMo Gym's session middleware has
        set the request's session id, and before the route."""
        from starlette.middleware import Middleware

        if getattr(app, "middleware_stack", None) is not None:
            raise RuntimeError("the app has served requests already: attach before serving")
        app.user_middleware.append(Middleware(_Restoring, exported=self))

    async def close(self) -> None:
        if self.owned:
            await self.restores.close()

    async def restore(self, scope: Scope, context: RolloutContext) -> None:
        """Restore the episode's sessions once per replacement attempt (``restore`` under the
        request's NeMo Gym session, ``retire`` of the one it supersedes)."""
        key = context.capture_key
        if key in self._restored:
            return
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._restored:
                return
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            projection = await continued_projection(
                self.restores,
                self.settings.run,
                context,
                restore_id_of(headers),
                deadline_s=self.deadline_s,
            )
            gym_id = str((scope.get("session") or {}).get(GYM_SESSION_ID))
            sessions = {} if projection is None else self.resources.restored_sessions(projection)
            for recorded in sessions.values():
                if not isinstance(recorded, dict) or recorded.get("state") is None:
                    continue
                await _call(self.user.restore(gym_id, recorded["state"]))
                old = recorded.get("gym_session")
                if old is not None and str(old) != gym_id:
                    await _call(self.user.retire(str(old)))
            self._restored.add(key)
        self._locks.pop(key, None)

    async def closed(self, scope: Scope) -> None:
        """``/close_session`` answered: retire the request's NeMo Gym session."""
        gym_id = (scope.get("session") or {}).get(GYM_SESSION_ID)
        if gym_id is not None:
            await _call(self.user.retire(str(gym_id)))


class _Restoring:
    """Innermost ASGI middleware of an exported server (``ExportedState.install``)."""

    def __init__(self, app: ASGIApp, exported: ExportedState) -> None:
        self.app = app
        self.exported = exported

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = current_context() if scope["type"] == "http" else None
        if context is None:
            await self.app(scope, receive, send)
            return
        if context.attempt > 0:
            await self.exported.restore(scope, context)
        status = 500

        async def seen(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, seen)
        if status < 400 and str(scope["path"]).endswith("/close_session"):
            await self.exported.closed(scope)
