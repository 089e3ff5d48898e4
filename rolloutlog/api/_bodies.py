"""Request bodies as they arrive: how fast each one comes (``BodyMeter``, kept by
``_app.BodyTimeout`` in the request's scope), and which append holding a slot gives it up to a
newcomer when every slot is taken (``slowest``).

The minimum body rate (``--min-body-rate``) refuses a trickled body at the end of its grace; but
a slow client that opens a new connection each time one is refused takes the freed slot back at
once, and with as many such clients as slots no other append would get one. So an append that
finds every slot taken takes the slot of the body that arrives slowest, if that body has been
waited for ``EVICTABLE_AFTER_S`` and averages below the minimum rate: that request is answered
``408 request_timeout`` as at the end of its grace, only sooner. Slow clients then only take
slots from each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["BODY_METER", "EVICTABLE_AFTER_S", "BodyMeter", "slowest"]

#: The request scope's key of its ``BodyMeter``.
BODY_METER = "rolloutlog.body_meter"
#: A body must have been waited for this long before its slot can go to another append.
EVICTABLE_AFTER_S = 1.0


class BodyMeter:
    """One request body: bytes received, seconds spent waiting for them (and since when it is
    waiting now), and whether its slot was given to another append (``evict``)."""

    __slots__ = ("evicted", "received", "released", "since", "task", "waited")

    def __init__(self) -> None:
        self.received = 0
        self.waited = 0.0
        #: The loop time its current wait for a part began; None: not waiting.
        self.since: float | None = None
        #: The task waiting (while ``since`` is set).
        self.task: asyncio.Task[object] | None = None
        #: Its slot went to another append (the service no longer counts it).
        self.released = False
        self.evicted = False

    def start(self, now: float, task: asyncio.Task[object] | None) -> None:
        """A wait for the body's next part begins (in ``task``)."""
        self.since, self.task = now, task

    def stop(self, now: float) -> None:
        """The wait ended (a part came, or it was refused)."""
        if self.since is not None:
            self.waited += now - self.since
        self.since = self.task = None

    def waited_s(self, now: float) -> float:
        return self.waited + (now - self.since if self.since is not None else 0.0)

    def evict(self) -> None:
        """Refuse the body now: its wait for the next part is cancelled (``BodyTimeout`` turns
        that into a ``408``)."""
        self.evicted = True
        if self.task is not None:
            self.task.cancel()


def slowest(meters: Iterable[BodyMeter], min_rate: int, now: float) -> BodyMeter | None:
    """Among the bodies being waited for now, waited for ``EVICTABLE_AFTER_S`` at least and
    averaging below ``min_rate`` bytes a second, the slowest; None if none."""
    found: BodyMeter | None = None
    found_rate = float(min_rate)
    for meter in meters:
        if meter.since is None or meter.task is None or meter.evicted:
            continue
        waited = meter.waited_s(now)
        if waited < EVICTABLE_AFTER_S:
            continue
        rate = meter.received / waited
        if rate < found_rate:
            found, found_rate = meter, rate
    return found
