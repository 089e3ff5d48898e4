"""The replica's partition leases (issue 17): which partitions of which runs this service folds.

``Ownership`` runs the catalog's lease tick (``Catalog.lease_tick``) once before the projectors
start and then every ``lease_s / 4`` (the heartbeat), and tells the coordinator which runs' owned
partitions or generations changed, so that it starts those runs' projectors afresh. A tick that
fails is retried with jittered backoff; meanwhile the replica keeps folding what it owned, but
once its lease has run out another replica may own those partitions at a newer generation, and
this one's writes for them are refused (``LeaseLost``): the fence, not this loop, keeps a paused
or cut-off replica from doing harm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping

from rolloutlog.catalog import Catalog
from rolloutlog.projections._timing import backoff_s

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_LEASE_S", "Ownership", "default_replica_id"]

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


class Ownership:
    """The lease loop of one replica; ``owned`` is what its last successful tick returned."""

    def __init__(
        self,
        catalog: Catalog,
        replica_id: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        address: str | None = None,
        on_change: Callable[[set[str]], None] = lambda runs: None,
    ) -> None:
        self.catalog = catalog
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.address = address
        self.owned: Owned = {}
        self._on_change = on_change
        self._fresh = True
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        #: When (monotonic) the last tick succeeded: the lease holds until lease_s after it.
        self._renewed_at = float("-inf")

    def of(self, run: str) -> Mapping[int, int]:
        """The run's owned partitions and their generations."""
        return self.owned.get(run, {})

    async def start(self) -> None:
        """The first tick (it must succeed: the catalog is reachable at start), then the loop."""
        await self.tick()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """End the loop (``release`` then gives the partitions up)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def release(self) -> None:
        """Release the leases, so the other replicas take over at once (a stopping replica)."""
        if self._fresh:
            return  # never ticked: nothing to release
        try:
            async with asyncio.timeout(_RELEASE_S):
                await self.catalog.release_leases(self.replica_id)
        except Exception as e:  # they lapse by themselves after lease_s
            logger.warning(
                "replica %s could not release its partitions (they lapse in %s s): %s",
                self.replica_id,
                self.lease_s,
                e,
            )
        self.owned = {}

    async def tick(self) -> Owned:
        """One lease tick now; the runs whose owned partitions changed go to ``on_change``."""
        async with self._lock:
            started = time.monotonic()
            owned = await self.catalog.lease_tick(
                self.replica_id,
                lease_s=self.lease_s,
                held=self.owned,
                address=self.address,
                fresh=self._fresh,
            )
            self._fresh = False
            self._renewed_at = started
            before, self.owned = self.owned, owned
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
            changed = {
                run for run in before.keys() | owned.keys() if before.get(run) != owned.get(run)
            }
        if changed:
            logger.info(
                "replica %s owns %s",
                self.replica_id,
                ", ".join(f"{run}: {_describe(owned.get(run, {}))}" for run in sorted(changed)),
            )
            self._on_change(changed)
        return owned

    async def _loop(self) -> None:
        failures = 0
        lapsed = False
        every = self.lease_s / 4
        while True:
            await asyncio.sleep(backoff_s(failures, every) if failures else every)
            try:
                await self.tick()
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


def _describe(partitions: Mapping[int, int]) -> str:
    if not partitions:
        return "no partitions"
    return " ".join(f"{p}@{g}" for p, g in sorted(partitions.items()))
