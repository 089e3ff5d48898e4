"""Restores (docs/design.md §6, §10 "A restore"): the runner around the pure planner
(``core/_planner.py``). It fences the controller, reads the checkpoint and its manifest, has the
restore planned per partition owner (``_part_planner.py``: this replica plans its own
partitions in-process, the other owners theirs when they see the request), writes the
``attempt.started`` records and commits the plan in one catalog transaction. A failure anywhere
commits nothing (the request is aborted): the projector discards the restore and the old
attempts stay current. A lone replica is one owner of every partition: its part is the whole
plan, and the restore's projections are built from it ahead of the fetch
(``_projection_server.py``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rolloutlog.catalog import Checkpoint, Restore, RestoreEntry, Run
from rolloutlog.core import PlannedEpisode, RestorePolicy, check_controller_epoch
from rolloutlog.log import Record, attempt_started_records, partition_for
from rolloutlog.projections._part_planner import PartPlanner, PlanPart, PlanRequest, plan_inputs
from rolloutlog.projections._projection_server import (
    ProjectionServer,
    committed_checkpoint,
)
from rolloutlog.projections._projector import Projector, _describe
from rolloutlog.projections._timing import StageTimer

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RESTORE_DEADLINE_S", "RestoreResult", "Restorer"]

#: How long the owners of a restore's partitions have to plan their parts: past it any replica
#: aborts the request (its requester waits as long for their parts).
DEFAULT_RESTORE_DEADLINE_S = 60.0


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore: Restore
    entries: tuple[RestoreEntry, ...]
    timings_ms: Mapping[str, float]
    #: Generation cuts dropped or restarted, by disposition (``planned_cut_dispositions``).
    cuts: Mapping[str, int] = field(default_factory=dict)


class Restorer:
    """Runs a service's restores over its part planner (``planner``) and serves their
    projections (``projections``)."""

    def __init__(
        self,
        planner: PartPlanner,
        projections: ProjectionServer,
        *,
        deadline_s: float = DEFAULT_RESTORE_DEADLINE_S,
    ) -> None:
        self.planner = planner
        self.projections = projections
        self.log = planner.log
        self.catalog = planner.catalog
        self.replica_id = planner.replica_id
        self.deadline_s = deadline_s
        self._projectors = planner.projectors
        #: This replica's requests being run (the planner's poller leaves them to this runner).
        self._requesting = planner.requesting

    async def poll(self) -> None:
        """Forever: plan this replica's parts of other replicas' requests
        (``PartPlanner.poll``)."""
        await self.planner.poll()

    async def restore(
        self,
        projector: Projector,
        controller_epoch: int,
        checkpoint_id: int | str,
        exclude: Iterable[str],
        policy: RestorePolicy,
        exclude_results: bool = False,
        lock: asyncio.Lock | None = None,
        *,
        settle_after: bool = False,
    ) -> RestoreResult:
        """Plan and commit a restore of the projector's run under the run's ``lock`` (the run's
        projector is not started afresh meanwhile, nor the run deleted; while the restore waits
        for other owners' parts it lets the lock go, ``PartPlanner.gather``).

        ``exclude_results``: also exclude every episode the plan would continue or restart whose
        finished result the catalog holds (the trainer reads it from the results route).

        ``settle_after``: return once the plan is committed, before the projector has taken
        the restore's resets when its lines are built ahead (``ProjectionServer.build_ahead``
        applies them after handing over the lines prepared at the checkpoint; the projector's
        fold waits for them, as it waits for any restore's verdict). What the REST route asks:
        the reply goes out while they are applied. Otherwise they are applied on return."""
        lock = lock or asyncio.Lock()
        async with lock:
            result, settled = await self._restore(
                lock,
                self._projectors.get(projector.run, projector),  # the current one, once locked
                controller_epoch,
                checkpoint_id,
                PlanRequest(frozenset(exclude), exclude_results, policy),
            )
            if not settle_after:
                await settled
        return result

    async def _restore(
        self,
        lock: asyncio.Lock,
        projector: Projector,
        controller_epoch: int,
        checkpoint_id: int | str,
        request: PlanRequest,
    ) -> tuple[RestoreResult, asyncio.Future[None]]:
        """The request is opened (its id reserved) and this replica's part planned; the other
        owners' parts gathered; the attempts written and the plan committed. A projector that
        owns every partition plans before it opens the request (a mistyped exclusion fails at
        once, and no other owner waits for the request: it writes no parts) and builds the
        restore's projections from its plan after the commit, which applies the restore's
        resets to the projector once the lines that need no tracker are handed over (the
        future returned is done then)."""
        run = projector.run
        timer = StageTimer()
        info = await self._fenced_run(run, controller_epoch)
        checkpoint = await committed_checkpoint(self.catalog, run, checkpoint_id)
        # This restore supersedes the run's earlier ones: their projections go now rather than
        # sit beside this one's replay (rebuilt from the log if still asked for).
        self.projections.cache.forget_run(run)
        manifest, current = await plan_inputs(
            self.catalog,
            run,
            checkpoint.checkpoint_id,
            projector.committed_manifest(checkpoint.checkpoint_id),
        )
        alone = projector.owns_every_partition

        async def plan_part() -> PlanPart:
            return await self.planner.plan_part(
                projector, checkpoint, manifest, current, request, timer
            )

        part = await plan_part() if alone else None
        restore_id = await self._open(projector, controller_epoch, checkpoint, request, part)
        committed = begun = False
        self._requesting[(run, restore_id)] = projector
        try:
            if part is None:
                part = await plan_part()
            projector.begin_restore(restore_id, part.resets, part.pins)
            begun = True
            planned, cuts, fences = await self.planner.gather(
                projector,
                checkpoint.checkpoint_id,
                manifest,
                request,
                restore_id,
                part,
                lock=lock,
                deadline_s=self.deadline_s,
                timer=timer,
            )
            restore, entries = await self._commit(
                info, controller_epoch, checkpoint.checkpoint_id, restore_id, planned, fences, timer
            )
            committed = True
        except BaseException as e:
            if part is not None and not begun:
                projector.release_pins(part.pins)
            await self._abort(run, restore_id, e)
            raise
        finally:
            del self._requesting[(run, restore_id)]
            if begun and not (committed and alone):
                projector.end_restore(restore_id, committed)
        settled = asyncio.get_running_loop().create_future()

        def settle() -> None:
            if settled.done():
                return
            if alone:
                projector.end_restore(restore_id, True)
                gc.freeze()  # the trackers' new states, as below
            settled.set_result(None)

        if alone:
            try:
                projector.retire_excluded(restore_id)
                # The fetch that follows the reply needs every continued projection.
                self.projections.build_ahead(
                    run, restore_id, projector, checkpoint, manifest, part, settle
                )
            except BaseException:
                settle()  # committed: the projector has its resets whatever failed here
                raise
        else:
            settle()
        # What stays (the trackers' states, the plan's projections): keep the collector from
        # walking it again and again (while the lines are handed over, too).
        gc.freeze()
        return RestoreResult(restore, entries, timer.total(), cuts), settled

    async def _open(
        self,
        projector: Projector,
        controller_epoch: int,
        checkpoint: Checkpoint,
        request: PlanRequest,
        part: PlanPart | None,
    ) -> int:
        """Open the restore's request (its id reserved, ``planning`` until its commit or
        abort); a part planned already has its pins released if that fails."""
        try:
            return await self.catalog.open_restore(
                projector.run,
                controller_epoch,
                checkpoint.checkpoint_id,
                requested_by=self.replica_id,
                request=request.to_json(),
                deadline_s=self.deadline_s,
            )
        except BaseException:
            if part is not None:
                projector.release_pins(part.pins)
            raise

    async def _commit(
        self,
        run: Run,
        controller_epoch: int,
        checkpoint_id: int,
        restore_id: int,
        planned: Sequence[PlannedEpisode],
        fences: Mapping[str, Mapping[int, int]],
        timer: StageTimer,
    ) -> tuple[Restore, tuple[RestoreEntry, ...]]:
        """Write the plan's ``attempt.started`` records, then commit it (one transaction,
        fenced by each planner's lease generations): the restore and its entries."""
        # The id was reserved (``open_restore``) before any record names it: a restore that
        # dies before its commit leaves attempt records under an id no later one can commit.
        await self._write_attempts(
            run.run, run.partitions, restore_id, checkpoint_id, planned, controller_epoch
        )
        timer.stage("attempts")
        entries = tuple(p.entry for p in planned)
        restore = await self.catalog.commit_restore(
            run.run,
            controller_epoch,
            checkpoint_id,
            entries,
            timings_ms=timer.total(),
            restore_id=restore_id,
            fences={r: g for r, g in fences.items() if g},
        )
        timer.stage("commit")
        return restore, entries

    async def _fenced_run(self, run: str, controller_epoch: int) -> Run:
        """The run, if ``controller_epoch`` is its controller's (``StaleController``)."""
        info = await self.catalog.get_run(run)
        check_controller_epoch(run, controller_epoch, info.controller_epoch)
        return info

    async def _write_attempts(
        self,
        run: str,
        partitions: int,
        restore_id: int,
        checkpoint_id: int,
        plan: Sequence[PlannedEpisode],
        controller_epoch: int,
    ) -> None:
        """One ``attempt.started`` per planned episode (``attempt_started_records``)."""
        entries = [planned.entry for planned in plan]
        values = attempt_started_records(
            [
                (e.episode, e.attempt, e.previous_attempt, p.cut)
                for e, p in zip(entries, plan, strict=True)
            ],
            restore_id=restore_id,
            checkpoint_id=checkpoint_id,
            controller_epoch=controller_epoch,
            ts=time.time(),
        )
        records = [
            Record(partition_for(e.episode, partitions), e.episode.encode(), value)
            for e, value in zip(entries, values, strict=True)
        ]
        for start in range(0, len(records), 4096):
            await self.log.append_records(run, records[start : start + 4096])

    async def _abort(self, run: str, restore_id: int, error: BaseException) -> None:
        """Abort a request that failed before its commit (best effort: else at its deadline)."""
        try:
            await self.catalog.abort_restore(run, restore_id, _describe(error))
        except Exception as e:
            logger.warning("run %s: could not abort restore %d: %s", run, restore_id, e)
