"""The replica's partition leases: which partitions of which runs this service folds.

``Ownership`` runs the catalog's lease tick (``Catalog.lease_tick``) once before the projectors
start and then every ``lease_s / 4`` (the heartbeat), and tells the coordinator which runs' owned
partitions or generations changed, so that it starts those runs' projectors afresh.

The heartbeat runs on a thread of its own, with its own event loop and its own catalog
connections (``Catalog.sibling``): a service whose event loop is busy (a long fold, a large
restore plan, a blocking call) keeps renewing its leases, so a live replica never loses its
partitions for being busy. Each tick also writes the replica's health report, which the service's
loop refreshes every ``lease_s / 4`` (``publish``): the report's age says how long that loop has
not answered, so the other replicas can name a replica that holds a run back although alive.

A tick that fails is retried with jittered backoff; meanwhile the replica keeps folding what it
owned, but once its lease has run out another replica may own those partitions at a newer
generation, and this one's writes for them are refused (``LeaseLost``): the fence, not this
loop, keeps a paused or cut-off replica from doing harm.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import orjson

from rolloutlog.catalog import Catalog
from rolloutlog.projections._timing import backoff_s

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEASE_S", "Ownership", "default_replica_id"]

T = TypeVar("T")

#: How long a replica's leases outlive its last heartbeat: a replica that died loses its
#: partitions within this (plus one heartbeat of the replica that takes them).
DEFAULT_LEASE_S = 6.0
#: The release on a graceful stop waits at most this for the catalog.
_RELEASE_S = 5.0

#: Owned partitions: run -> partition -> the lease generation it is held at.
Owned = dict[str, dict[int, int]]


def default_replica_id(port: int | None = None) -> str:
    """``<hostname>:<port>``: stable across a restart on the same host and port (the restarted
    replica takes its own partitions back at once), and two live processes cannot share it."""
    host = socket.gethostname()
    return host if port is None else f"{host}:{port}"


class _Thread:
    """A daemon thread running an event loop of its own: the heartbeat's home."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the thread's loop; the caller's loop awaits it."""
        return await asyncio.wrap_future(self.submit(coroutine))

    async def close(self) -> None:
        """Stop the loop and wait (a bounded time: a daemon thread stuck in a call is left)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, _RELEASE_S)


class Ownership:
    """The lease loop of one replica; ``owned`` is what its last successful tick returned, as
    the service's event loop has taken it in."""

    def __init__(
        self,
        catalog: Catalog,
        replica_id: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        address: str | None = None,
        on_change: Callable[[set[str]], None] = lambda runs: None,
        heartbeat_catalog: Callable[[], Catalog] | None = None,
    ) -> None:
        self.catalog = catalog
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.address = address
        self.owned: Owned = {}
        self._on_change = on_change
        #: Opens the heartbeat's own catalog (on the heartbeat's thread).
        self._open_catalog = heartbeat_catalog or catalog.sibling
        self._fresh = True
        # The heartbeat thread's state (touched only on its loop).
        self._thread: _Thread | None = None
        self._ticker: Catalog | None = None
        self._tick_lock: asyncio.Lock | None = None
        self._held: Owned = {}
        self._ticks = 0
        self._beat: concurrent.futures.Future[None] | None = None
        #: When (monotonic) the last tick succeeded: the lease holds until lease_s after it.
        self._renewed_at = float("-inf")
        # The service's loop's side.
        self._service_loop: asyncio.AbstractEventLoop | None = None
        self._applied_tick = 0
        #: The service's latest health report and when (monotonic) it was made (``publish``).
        self._report: tuple[float, Mapping[str, Any]] | None = None

    def of(self, run: str) -> Mapping[int, int]:
        """The run's owned partitions and their generations."""
        return self.owned.get(run, {})

    def publish(self, report: Mapping[str, Any]) -> None:
        """The service's health report, written by the heartbeat's next ticks with its age."""
        self._report = (time.monotonic(), report)

    async def start(self) -> None:
        """The first tick (it must succeed: the catalog is reachable at start), then the loop."""
        try:
            await self.tick()
        except BaseException:
            await self.release()  # the thread and its catalog go with the failed start
            raise
        assert self._thread is not None
        self._beat = self._thread.submit(self._loop())

    async def stop(self) -> None:
        """End the loop (``release`` then gives the partitions up)."""
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError, asyncio.CancelledError):
                await asyncio.wrap_future(beat)

    async def release(self) -> None:
        """Release the leases, so the other replicas take over at once (a stopping replica),
        and close the heartbeat's thread."""
        await self.stop()
        thread, self._thread = self._thread, None
        if thread is None:
            return  # never ticked: nothing to release
        try:
            if not self._fresh:
                try:
                    await thread.run(self._release())
                except Exception as e:  # they lapse by themselves after lease_s
                    logger.warning(
                        "replica %s could not release its partitions (they lapse in %s s): %s",
                        self.replica_id,
                        self.lease_s,
                        e,
                    )
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_RELEASE_S):
                    await thread.run(self._close_catalog())
        finally:
            await thread.close()
        self.owned = {}

    async def tick(self) -> Owned:
        """One lease tick now (on the heartbeat's thread); the runs whose owned partitions
        changed go to ``on_change``."""
        if self._thread is None:
            self._service_loop = asyncio.get_running_loop()
            thread = _Thread(f"rolloutlog-heartbeat-{self.replica_id}")
            try:
                await thread.run(self._open())
            except BaseException:
                await thread.close()
                raise
            self._thread = thread
        number, owned = await self._thread.run(self._tick())
        self._take(number, owned)
        return owned

    # -- on the heartbeat's thread ---------------------------------------------------------

    async def _open(self) -> None:
        self._tick_lock = asyncio.Lock()
        ticker = self._open_catalog()
        await ticker.start()
        self._ticker = ticker

    async def _close_catalog(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            await ticker.stop()

    async def _release(self) -> None:
        assert self._ticker is not None
        async with asyncio.timeout(_RELEASE_S):
            await self._ticker.release_leases(self.replica_id)

    async def _tick(self) -> tuple[int, Owned]:
        assert self._ticker is not None and self._tick_lock is not None
        async with self._tick_lock:
            started = time.monotonic()
            owned = await self._ticker.lease_tick(
                self.replica_id,
                lease_s=self.lease_s,
                held=self._held,
                address=self.address,
                fresh=self._fresh,
                health=self._health(),
            )
            self._fresh = False
            self._renewed_at = started
            before, self._held = self._held, owned
            bumped = [
                (run, partition)
                for run, partitions in owned.items()
                for partition, generation in partitions.items()
                if before.get(run, {}).get(partition, generation) != generation
            ]
            if bumped:  # this replica held them and took them again: someone else wrote
                logger.error(
                    "replica %s found its own partitions (%s) claimed at another generation: "
                    "another live process uses the same replica id (give each its own "
                    "--replica-id), or a tick's reply was lost",
                    self.replica_id,
                    ", ".join(f"{run}/{p}" for run, p in bumped[:8]),
                )
            self._ticks += 1
            return self._ticks, owned

    def _health(self) -> str | None:
        found = self._report
        if found is None:
            return None
        made_at, report = found
        age_s = round(max(0.0, time.monotonic() - made_at), 3)
        return orjson.dumps({**report, "age_s": age_s, "lease_s": self.lease_s}).decode()

    async def _loop(self) -> None:
        failures = 0
        lapsed = False
        every = self.lease_s / 4
        while True:
            await asyncio.sleep(backoff_s(failures, every) if failures else every)
            try:
                number, owned = await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the catalog is unreachable: keep folding, say so
                failures += 1
                if failures == 1:
                    logger.warning(
                        "replica %s could not renew its partition leases; it keeps folding and "
                        "retries: %s",
                        self.replica_id,
                        e,
                    )
                if not lapsed and time.monotonic() - self._renewed_at > self.lease_s:
                    lapsed = True
                    logger.error(
                        "replica %s: its partition leases ran out (%s s without a renewal): "
                        "other replicas may own its partitions now, and its checkpoint and "
                        "restore writes for them are refused until it renews",
                        self.replica_id,
                        self.lease_s,
                    )
                continue
            lapsed = False
            if failures:
                logger.info(
                    "replica %s renewed its partition leases after %d failed attempts",
                    self.replica_id,
                    failures,
                )
            failures = 0
            loop = self._service_loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the service's loop is closed
                    loop.call_soon_threadsafe(self._take_beat, number, owned)

    # -- on the service's loop -------------------------------------------------------------

    def _take_beat(self, number: int, owned: Owned) -> None:
        """A heartbeat's result, unless the loop was stopped meanwhile (nothing starts anew)."""
        if self._beat is not None:
            self._take(number, owned)

    def _take(self, number: int, owned: Owned) -> None:
        """Take in tick ``number``'s result (unless a later one was taken already)."""
        if number <= self._applied_tick:
            return
        self._applied_tick = number
        before, self.owned = self.owned, owned
        changed = {run for run in before.keys() | owned.keys() if before.get(run) != owned.get(run)}
        if changed:
            logger.info(
                "replica %s owns %s",
                self.replica_id,
                ", ".join(f"{run}: {_describe(owned.get(run, {}))}" for run in sorted(changed)),
            )
            self._on_change(changed)


def _describe(partitions: Mapping[int, int]) -> str:
    if not partitions:
        return "no partitions"
    return " ".join(f"{p}@{g}" for p, g in sorted(partitions.items()))
