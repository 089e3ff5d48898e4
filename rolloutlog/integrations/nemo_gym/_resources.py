"""NeMo Gym resources servers as rolloutlog participants, through ASGI middleware only.

``attach_resources`` wraps the app that ``SimpleResourcesServer.setup_webserver()`` built (the
server's code is untouched) in the SDK's ``ResourcesMiddleware`` (one ``Resources`` participant
per server) behind ``GymContextMiddleware`` (the rollout context from headers or cookies):

- ``/seed_session``: ``session.started`` before the reply leaves, and the reply says the verify
  mode (``x-ng-checkpoint-verify``) and, for ``restart_only``, ``x-ng-checkpoint-restart: 1``;
- every other successful reply of an ``exported`` server: ``session.state`` from its state hook;
- ``/close_session`` (a server that has one): ``session.ended``. NeMo Gym 0.4.0 has none and
  ``/verify`` does not end a session: its state must outlive a verify that replays (a checkpoint
  between verify and the episode's finish continues the episode from before verify). A session
  is over when its episode finishes (a finished episode is never continued).

Modes (the server's ``rolloutlog.mode``): ``restart_only`` (default; fails closed: an episode
with a live session restarts), ``stateless`` (nothing to restore: its episodes continue),
``exported`` (``rolloutlog.state``: ``"module:factory"``, ``factory(server)`` returns the
server's ``StateHooks``: export, restore and retire over its own state, ``_exported``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rolloutlog.integrations.nemo_gym._config import GymSettings, load_object
from rolloutlog.integrations.nemo_gym._context import GymContextMiddleware
from rolloutlog.integrations.nemo_gym._exported import ExportedState
from rolloutlog.participants import (
    CAPTURE_KEY_HEADER,
    Resources,
    ResourcesMiddleware,
    Restores,
    Transport,
)

if TYPE_CHECKING:  # plain ASGI: starlette is not needed to run it
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["MODES", "attach_resources", "on_lifespan"]

#: The session modes a NeMo Gym resources server may declare.
MODES = ("restart_only", "stateless", "exported")
#: Routes of a resources server that are not rollout work (never refused for want of a context).
EXEMPT = ("/aggregate_metrics", "/docs", "/openapi.json")


def on_lifespan(
    app: Any,
    startup: Callable[[], Awaitable[None]],
    shutdown: Callable[[], Awaitable[None]],
) -> None:
    """Run ``startup``/``shutdown`` around a FastAPI app's lifespan (as NeMo Gym's own
    ``setup_profiling`` wraps ``app.router.lifespan_context``)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        await startup()
        try:
            async with inner(app_) as state:
                yield state
        finally:
            await shutdown()

    app.router.lifespan_context = lifespan


class _Registered:
    """Registers the participant on its first rollout request (the run exists by then: the
    trainer creates it before dispatching), so a server starts before or without the service."""

    def __init__(self, app: ASGIApp, resources: Resources) -> None:
        self.app = app
        self.resources = resources
        self._lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.resources.epoch is None and scope["type"] == "http":
            names = {name for name, _ in scope.get("headers", ())}
            if CAPTURE_KEY_HEADER.encode() in names:
                async with self._lock:
                    if self.resources.epoch is None:
                        await self.resources.register()
        await self.app(scope, receive, send)


async def _nothing() -> None:
    pass


def attach_resources(
    server: Any,
    app: Any,
    settings: GymSettings,
    *,
    transport: Transport | None = None,
    restores: Restores | None = None,
) -> ASGIApp:
    """The ASGI app to serve for NeMo Gym resources server ``server`` (its ``app`` from
    ``setup_webserver()``), recording its sessions as participant ``settings.participant_id``.

    Options (``settings.options``): ``mode``, ``verify`` (``replay``/``wait``, default ``wait``:
    a verify in flight is never run twice), ``state`` (exported: ``"module:factory"`` of its
    ``StateHooks``; ``deadline_s``, how long a restore rides through an unreachable service),
    ``rollout_id_required`` (refuse rollout routes without a context: work no checkpoint
    accounts for).
    ``transport``: the participant's (default ``settings.transport()``, started and stopped with
    the app's lifespan; a given one is the caller's to start and stop); ``restores``: where an
    exported server's replacement attempts fetch their projections (default: the service's)."""
    options = settings.options
    mode = str(options.get("mode", "restart_only"))
    if mode not in MODES:
        raise ValueError(
            f"resources server {settings.participant_id}: mode {mode!r} not in {MODES}"
        )
    if mode == "exported" and not options.get("state"):
        raise ValueError(
            f"resources server {settings.participant_id}: mode exported needs rolloutlog.state "
            "('module:factory' returning its export, restore and retire)"
        )
    owned = transport is None
    transport = settings.transport() if transport is None else transport
    resources = Resources(
        transport,
        settings.run,
        settings.participant_id,
        mode=mode,  # type: ignore[arg-type]
        verify=str(options.get("verify", "wait")),  # type: ignore[arg-type]
    )
    if owned:
        on_lifespan(app, transport.start, transport.stop)
    exported = None
    if mode == "exported":
        user = load_object(str(options["state"]))(server)
        exported = ExportedState(user, settings, resources, restores)
        exported.install(app)
        on_lifespan(app, _nothing, exported.close)
    recorded = ResourcesMiddleware(
        app,
        resources,
        state=None if exported is None else exported.record,
        rollout_id_required=bool(options.get("rollout_id_required", False)),
        exempt=EXEMPT,
    )
    return GymContextMiddleware(_Registered(recorded, resources), liveness=app)
