"""The participant base: identity, registration, ``seq`` numbering and the write-ahead append."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, get_args

from rolloutlog.errors import BackendUnavailable, UnknownRun
from rolloutlog.log import (
    Opaque,
    ParticipantKind,
    Position,
    capture_key,
    name_problem,
    parse_capture_key,
    task_digest,
)
from rolloutlog.participants._transport import Transport

__all__ = ["Participant", "RolloutContext", "task_digest"]

#: The kinds a participant may register as (the envelopes it builds carry its kind unchecked).
_KINDS = frozenset(get_args(ParticipantKind))


@dataclass(frozen=True, slots=True)
class RolloutContext:
    """Which attempt of which episode a piece of work belongs to (and its step, when known)."""

    episode: str
    attempt: int = 0
    step: int | None = None

    @property
    def capture_key(self) -> str:
        return capture_key(self.episode, self.attempt)

    @classmethod
    def of(cls, key: str | RolloutContext, step: int | None = None) -> RolloutContext:
        """A context from a capture key (``r17``, ``r17-a2``) or a context (a new step, if given)."""
        if isinstance(key, RolloutContext):
            return key if step is None else cls(key.episode, key.attempt, step)
        episode, attempt = _parse(key)
        return cls(episode, attempt, step)


@lru_cache(maxsize=1 << 14)
def _parse(key: str) -> tuple[str, int]:
    return parse_capture_key(key)


def checked_name(what: str, name: str) -> str:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(f"invalid {what} {name!r}: {problem}")
    return name


class Participant:
    """A process that appends events: ``id``, ``kind`` and the ``epoch`` registration grants.

    ``seq`` counts this participant's events per (id, epoch); every event is awaited until durable
    (the write-ahead rule) unless a method says otherwise.
    """

    kind: ClassVar[ParticipantKind]

    def __init__(self, transport: Transport, run: str, participant_id: str) -> None:
        self.transport = transport
        self.run = run
        self.id = checked_name("participant id", participant_id)
        self.epoch: int | None = None
        self.seq = 0
        self._who: dict[str, Any] = {}

    async def register(self, *, wait_s: float = 0.0) -> int:
        """Register with the service; a new epoch fences every earlier incarnation of this id.

        ``wait_s``: how long to keep trying while the service is unreachable or the run does not
        exist yet (a participant started beside the service, or before the trainer made the run).
        """
        if self.kind not in _KINDS:
            raise ValueError(f"unknown participant kind {self.kind!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                epoch = await self.transport.register(self.run, self.id, self.kind)
                break
            except (BackendUnavailable, UnknownRun):
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.05)
        self.epoch = epoch
        self.seq = 0
        self._who = {"id": self.id, "kind": self.kind, "epoch": self.epoch}
        return self.epoch

    async def emit(
        self,
        type_: str,
        context: RolloutContext,
        data: dict[str, Any],
        *,
        step: int | None = None,
    ) -> Position:
        """Append one event of this participant and return once it is durable."""
        # emit_nowait inlined: this is the hot path, one coroutine frame less per event
        self._check_registered()
        transport = self.transport
        if not transport.try_reserve():
            await transport.reserve()
        event = self._next_event(type_, context, data, step)
        return await transport.submit(self.run, event, built=True)

    async def emit_nowait(
        self,
        type_: str,
        context: RolloutContext,
        data: dict[str, Any],
        *,
        step: int | None = None,
    ) -> asyncio.Future[Position]:
        """Reserve a slot, number and submit the event; returns the future of its position.

        Waiting on the budget is the only ``await`` before numbering, so ``seq`` order is
        submission order.
        """
        self._check_registered()
        if not self.transport.try_reserve():
            await self.transport.reserve()
        event = self._next_event(type_, context, data, step)
        return self.transport.submit(self.run, event, built=True)

    def _check_registered(self) -> None:
        if self.epoch is None:
            raise RuntimeError(f"participant {self.id!r} is not registered: call register()")

    def _next_event(
        self, type_: str, context: RolloutContext, data: dict[str, Any], step: int | None
    ) -> dict[str, Any]:
        """The next envelope of this participant (numbered), in the codec's field order (see
        ``_encoding``): records then start with the episode."""
        self.seq += 1
        return {
            "v": 1,
            "episode": context.episode,
            "attempt": context.attempt,
            "step": context.step if step is None else step,
            "participant": self._who,
            "seq": self.seq,
            "ts": time.time(),
            "type": type_,
            "data": data,
        }


def opaque(value: Any) -> Opaque:
    """A payload as ``Opaque`` (encoded once; an ``Opaque`` passes through)."""
    return value if isinstance(value, Opaque) else Opaque.of(value)
