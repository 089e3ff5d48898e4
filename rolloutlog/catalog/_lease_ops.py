"""The controller takeover and the partition leases: the catalog's fencing operations
(``Catalog`` composes them).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import _leases, _reads
from rolloutlog.catalog._leases import ClusterView, PartitionOwner
from rolloutlog.catalog._schema import checkpoints, runs
from rolloutlog.catalog._transactions import CatalogTransactions
from rolloutlog.catalog._validate import check_name, check_positive_seconds
from rolloutlog.catalog._writes import drop_checkpoint_parts, lock_run
from rolloutlog.errors import StaleController


class LeaseOperations(CatalogTransactions):
    """``Catalog``'s operations on the controller takeover and partition leases."""

    async def take_over_controller(self, run: str, *, expected_epoch: int | None = None) -> int:
        """Become the run's controller; return the new controller epoch.

        With ``expected_epoch`` this is a compare-and-set: it fails with ``StaleController`` unless
        the current epoch is still ``expected_epoch``, so of two takeovers that saw the same epoch
        exactly one wins. Checkpoints left pending by the previous controller are aborted.
        """
        async with self._write() as conn:
            row = await lock_run(conn, run)
            current = int(row.controller_epoch)
            if expected_epoch is not None and expected_epoch != current:
                raise StaleController(
                    f"controller epoch of run {run!r} is {current}, not {expected_epoch}",
                    run=run,
                    expected_epoch=expected_epoch,
                    current_epoch=current,
                )
            new_epoch = current + 1
            await conn.execute(
                update(runs).where(runs.c.run == run).values(controller_epoch=new_epoch)
            )
            aborted = await conn.execute(
                update(checkpoints)
                .where(checkpoints.c.run == run, checkpoints.c.status == "pending")
                .values(
                    status="aborted",
                    ended_at=self._clock(),
                    reason=f"controller taken over by epoch {new_epoch}",
                )
                .returning(checkpoints.c.checkpoint_id)
            )
            for checkpoint_id in list(aborted.scalars()):
                await drop_checkpoint_parts(conn, run, checkpoint_id)
            return new_epoch

    async def lease_tick(
        self,
        replica_id: str,
        *,
        lease_s: float,
        held: Mapping[str, Mapping[int, int]],
        address: str | None = None,
        fresh: bool = False,
        health: str | None = None,
    ) -> dict[str, dict[int, int]]:
        """Renew the replica's heartbeat and move its leases towards the balanced assignment;
        return the partitions it owns (run -> partition -> generation). ``held``: what its
        previous tick returned; ``fresh``: the process's first tick; ``health``: its report
        (JSON) for ``cluster_view``."""
        check_name(replica_id, "replica_id")
        check_positive_seconds(lease_s, "lease_s")
        async with self._write() as conn:
            return await _leases.tick(
                conn,
                self._backend,
                self._clock,
                replica_id,
                address=address,
                lease_s=lease_s,
                held=held,
                fresh=fresh,
                health=health,
            )

    async def cluster_view(self, run: str | None = None) -> ClusterView:
        """Every run's (or one run's) leases with their owners' heartbeats and reports."""
        return await self._query(
            lambda conn: _leases.cluster_view(conn, self._backend, self._clock, run)
        )

    async def release_leases(self, replica_id: str) -> None:
        """The replica stops: its partitions are released and its heartbeat ends now."""
        async with self._write() as conn:
            await _leases.release_replica(conn, self._backend, self._clock, replica_id)

    async def partition_owners(self, run: str) -> list[PartitionOwner]:
        """Each partition of the run with its owner and generation (``UnknownRun``)."""

        async def query(conn: AsyncConnection) -> list[PartitionOwner]:
            info = await _reads.get_run(conn, run)
            return await _leases.partition_owners(
                conn, self._backend, self._clock, run, info.partitions
            )

        return await self._query(query)
