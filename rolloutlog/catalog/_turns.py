"""Turns for an embedded (SQLite) catalog's writers (the S4 workload).

SQLite has one writer at a time, and makes the others poll for its lock: its busy handler sleeps
up to 100 ms between tries. A checkpoint's transactions behind the projector's batches of
episode starts (a few thousand rows each while participants start rollouts) waited hundreds of
milliseconds that way. The catalog's writers take turns here instead, each woken the moment the
one before ends, and a checkpoint's writes (``urgent``) go before the others waiting."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["WriteTurns"]


class WriteTurns:
    """One writer at a time, in order of arrival, urgent ones first."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[bool, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @asynccontextmanager
    async def turn(self, *, urgent: bool = False) -> AsyncIterator[None]:
        if self._busy:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (not urgent, next(self._arrivals), future))
            try:
                await future
            except BaseException:
                if future.done() and not future.cancelled():  # handed the turn, then cancelled
                    self._hand_on()
                raise  # a cancelled wait stays in the heap, skipped when its turn comes
        else:
            self._busy = True
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        while self._waiting:
            future = heapq.heappop(self._waiting)[2]
            if not future.done():
                future.set_result(None)
                return
        self._busy = False
