"""A rolloutlog participant inside the app of a NeMo Gym agent or model server.

``Attachment`` is what the integration's server subclasses attach to the FastAPI app NeMo Gym
built, as the resources middleware does (``_resources``): the transport started and stopped with
the app's lifespan (``on_lifespan``), the participant registered on the first rollout request
(the run exists by then, so a server starts before or without the service), the SDK's
``RolloutContextMiddleware`` (``current_context()`` in every request), and the projection a
replacement attempt continues from: from the restore its request names
(``x-rolloutlog-restore-id``), else from the run's latest restore.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from rolloutlog.integrations.nemo_gym._config import GymSettings
from rolloutlog.integrations.nemo_gym._context import RESTORE_HEADER, restore_id_of
from rolloutlog.integrations.nemo_gym._exported import continued_projection
from rolloutlog.integrations.nemo_gym._resources import _Registered, on_lifespan
from rolloutlog.participants import (
    DEFAULT_DEADLINE_S,
    Participant,
    Restores,
    RolloutContext,
    RolloutContextMiddleware,
    Transport,
)

__all__ = ["Attachment", "current_restore_id", "restore_headers"]

P = TypeVar("P", bound=Participant)

_RESTORE: ContextVar[int | None] = ContextVar("rolloutlog_nemo_gym_restore", default=None)


def current_restore_id() -> int | None:
    """The restore the request being handled continues from (``Attachment.restore``)."""
    return _RESTORE.get()


def restore_headers() -> dict[str, str]:
    """The header that carries the current restore id to the next hop (empty without one)."""
    restore_id = _RESTORE.get()
    return {} if restore_id is None else {RESTORE_HEADER: str(restore_id)}


class Attachment(Generic[P]):
    """A participant of kind ``P`` inside a NeMo Gym app (module docstring). Options read from
    the server's ``rolloutlog:`` dict: ``deadline_s`` (how long a projection fetch rides through
    an unreachable service) and ``rollout_id_required``. ``workers``: the server's
    ``num_workers``; more than one is refused (each worker would register the same id)."""

    def __init__(
        self, settings: GymSettings, make: Callable[[Transport, str], P], *, workers: int | None
    ) -> None:
        if workers is not None and workers > 1:
            # each uvicorn worker would register the same participant id and fence the others
            raise ValueError(
                f"{settings.participant_id}: rolloutlog attaches to one worker process "
                f"(num_workers is {workers}): run one server per participant id"
            )
        self.settings = settings
        self.transport = settings.transport()
        self.participant: P = make(self.transport, settings.participant_id)
        self.restores = Restores(settings.url, token=settings.token)
        self.deadline_s = float(settings.options.get("deadline_s", DEFAULT_DEADLINE_S))
        #: run in the app's lifespan, after the transport started / before it stops
        self.on_start: list[Callable[[], Awaitable[None]]] = []
        self.on_stop: list[Callable[[], Awaitable[None]]] = []

    def attach(self, app: Any, *, exempt: tuple[str, ...] = ()) -> None:
        """Wire the participant into ``app`` (a FastAPI app), in place."""
        on_lifespan(app, self._start, self._stop)
        app.add_middleware(
            RolloutContextMiddleware,
            rollout_id_required=bool(self.settings.options.get("rollout_id_required", False)),
            exempt=exempt,
        )
        app.add_middleware(_Registered, resources=self.participant)

    async def _start(self) -> None:
        await self.transport.start()
        for hook in self.on_start:
            await hook()

    async def _stop(self) -> None:
        for hook in self.on_stop:
            with contextlib.suppress(Exception):
                await hook()
        await self.restores.close()
        with contextlib.suppress(Exception):
            await self.transport.stop()

    @contextlib.contextmanager
    def restore(self, headers: Mapping[str, str]) -> Iterator[None]:
        """Within: ``current_restore_id()`` is the restore a request's headers name."""
        token = _RESTORE.set(restore_id_of(headers))
        try:
            yield
        finally:
            _RESTORE.reset(token)

    async def projection(self, context: RolloutContext) -> dict[str, Any] | None:
        """The projection a replacement attempt continues from (``current_restore_id()``, else
        the latest restore); None for attempt 0, or when the restore did not continue it."""
        return await continued_projection(
            self.restores,
            self.settings.run,
            context,
            current_restore_id(),
            deadline_s=self.deadline_s,
        )
