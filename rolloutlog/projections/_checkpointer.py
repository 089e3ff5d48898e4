"""Checkpoints (docs/design.md §6, §10 "A checkpoint"): controller epoch check and a ``pending``
row → markers into every partition → each partition's owner (every replica's projector, for the
partitions it owns) reaches its marker (the manifest of each partition is taken right there) →
episodes with an open wait step extend their cut to that step's boundary, or restart at the
deadline → each owner writes its partitions' parts in one catalog transaction, and the last one
in commits the checkpoint, manifest-last (a lone replica: one transaction). Participants never
pause. The requester aborts the ``pending`` row on any failure (retried until the catalog takes
it) and when not every part came by the deadline (plus a grace); any replica's sweep aborts one
still pending later (its requester is gone)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, cast

from rolloutlog.catalog import Catalog, Checkpoint
from rolloutlog.core import replay_start
from rolloutlog.errors import (
    BackendUnavailable,
    CheckpointInProgress,
    CheckpointNotPending,
    LeaseLost,
    RolloutlogError,
    StaleController,
)
from rolloutlog.log import Log
from rolloutlog.projections._capture import CheckpointCapture
from rolloutlog.projections._manifest_writer import (
    Delta,
    StagingDelta,
    end_committed,
    staging_keys,
    write_parts,
)
from rolloutlog.projections._prepared import RestorePreparer
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._timing import StageTimer, backoff_s
from rolloutlog.projections._waits import ExportRequests, reach_markers, resolve_waits

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_WAIT_DEADLINE_S",
    "GRACE_S",
    "CheckpointOptions",
    "CheckpointResult",
    "Checkpointer",
    "StagingDelta",
]


#: How long a checkpoint waits for open wait steps when the request names no deadline; also how
#: long a checkpoint or restore waits for the projector to reach the log's offsets.
DEFAULT_WAIT_DEADLINE_S = 30.0
#: Past a checkpoint's deadline, how long its requester still waits for the other replicas'
#: parts before it aborts it; the sweep aborts one still pending twice as long past it.
GRACE_S = 5.0
#: How often a replica polls the catalog for the outcome of a checkpoint another one commits.
POLL_S = 0.025
#: How often the sweep looks for checkpoints pending past their deadline.
SWEEP_EVERY_S = 1.0
#: How long a ``wait=false`` checkpoint waits for other replicas' parts before it answers that it
#: is pending (their partitions may hold wait steps this replica cannot see).
REMOTE_PARTS_WAIT_S = 1.0


class CheckpointOptions(TypedDict, total=False):
    """How a checkpoint is asked for: ``Checkpointer.checkpoint``'s keywords, which
    ``Coordinator.checkpoint`` passes on."""

    deadline_s: float | None
    wait: bool
    trigger: str
    staging_since: int | None
    request_id: str | None


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    checkpoint: Checkpoint
    #: Every staging key the manifest references; None when ``staging_delta`` says it instead.
    staging_keys: tuple[str, ...] | None
    timings_ms: Mapping[str, float]
    staging_delta: StagingDelta | None = None


class Checkpointer:
    """Runs a service's checkpoints over the log, the runs' projectors and the catalog: those it
    is asked for, and its projectors' parts of those other replicas are asked for (``attach``)."""

    def __init__(
        self,
        log: Log,
        catalog: Catalog,
        projector: Callable[[str], Awaitable[Projector]],
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        *,
        replica_id: str = "",
        grace_s: float = GRACE_S,
        preparer: RestorePreparer | None = None,
    ) -> None:
        self.log = log
        #: Prepares a restore's lines once a checkpoint captured whole commits.
        self._preparer = preparer
        self.catalog = catalog
        self._projector = projector
        self._spawn = spawn
        self._exports = ExportRequests()
        self.replica_id = replica_id
        self.grace_s = grace_s
        #: Per run, the checkpoint whose staging keys this replica's projector holds whole (its
        #: base's, as its reply listed them): a requester that names it gets a delta.
        self._staged: dict[str, int] = {}
        #: Per run and partition, the offset this service last trimmed the log below.
        self._trimmed: dict[str, dict[int, int]] = {}
        #: Per run, its trims under way (``forget_run`` ends them).
        self._trims: dict[str, set[asyncio.Task[None]]] = {}

    async def forget_run(self, run: str) -> None:
        """A deleted run: a run created again under its name starts its offsets and checkpoints
        afresh (a stale trim floor would hold its trims off until its offsets passed it). A
        trim under way ends first: it would put its floor back, or trim the new run's log by
        the deleted run's checkpoints."""
        trims = self._trims.pop(run, set())
        for task in trims:
            task.cancel()
        await asyncio.gather(*trims, return_exceptions=True)
        self._staged.pop(run, None)
        self._trimmed.pop(run, None)

    def _spawn_trim(self, run: str) -> None:
        task = self._spawn(self._trim(run))
        if isinstance(task, asyncio.Task):
            trims = self._trims.setdefault(run, set())
            trims.add(task)
            task.add_done_callback(trims.discard)

    def attach(self, projector: Projector) -> None:
        """Write the projector's parts of checkpoints other replicas requested."""
        projector.on_remote_capture = lambda capture: self._spawn(self._remote(projector, capture))

    async def checkpoint(
        self,
        run: str,
        controller_epoch: int,
        *,
        deadline_s: float | None = None,
        wait: bool = True,
        trigger: str = "request",
        staging_since: int | None = None,
        request_id: str | None = None,
    ) -> CheckpointResult | int:
        """Take a checkpoint. Returns the committed result, or (``wait=False`` while wait steps
        are still open) the id of the checkpoint that stays ``pending`` and commits later.
        ``staging_since``: the requester holds that checkpoint's staging keys; the result says
        what changed from them when this replica can (``staging_delta``), else lists them all.
        ``request_id``: the client's id of the request; sent again, it is answered with the
        checkpoint begun for it (``_answered``: the catalog refuses to begin another)."""
        projector = await self._projector(run)
        projector.check_running()
        timer = StageTimer()
        try:
            checkpoint_id = await self.catalog.begin_checkpoint(
                run,
                controller_epoch,
                trigger=trigger,
                deadline_s=deadline_s,
                requested_by=self.replica_id,
                request_id=request_id,
            )
        except CheckpointInProgress:
            answered = None if request_id is None else await self._answered(run, request_id, wait)
            if answered is None:
                raise
            return answered
        await projector.capture_outcome()  # of a checkpoint another replica committed just now
        if self._preparer is not None:
            self._preparer.pause(run)  # the previous checkpoint's: it would hold the loop
        timer.stage("begin")
        deadline = deadline_s if deadline_s is not None else DEFAULT_WAIT_DEADLINE_S
        capture = projector.begin_capture(checkpoint_id)
        try:
            await self.log.write_markers(run, checkpoint_id, controller_epoch)
            marked_at = time.time()
            timer.stage("markers")
            # A degraded projector may not get there: the checkpoint then fails (``unavailable``)
            # at its deadline instead of hanging, and the next one succeeds once it recovers.
            reached = await reach_markers(projector, capture, deadline)
            projector.check_running()
            timer.stage("projector")
        except BaseException:
            await self._abort(projector, controller_epoch, capture, "marking failed")
            raise
        if not reached:
            # The partitions changed owner meanwhile (this replica's projector was replaced,
            # or a newer checkpoint took its place): their owners' projectors, started afresh,
            # meet the markers caught up and write the parts; or it was aborted.
            if not wait:
                return checkpoint_id
            return await self._handed_over(
                run, checkpoint_id, controller_epoch, timer, marked_at + deadline
            )
        if capture.waiting:
            self._exports.open(projector, capture, marked_at + deadline)
        if capture.waiting and not wait:
            self._spawn(
                self._finish(
                    projector, controller_epoch, capture, timer, deadline, marked_at, staging_since
                )
            )
            return checkpoint_id
        if not wait and len(capture.owned) < projector.partitions:
            # Other replicas own partitions whose wait steps this one cannot see: pending (202)
            # unless their parts commit it at once.
            finishing = cast(
                "asyncio.Task[CheckpointResult]",
                self._spawn(
                    self._finish(
                        projector,
                        controller_epoch,
                        capture,
                        timer,
                        deadline,
                        marked_at,
                        staging_since,
                    )
                ),
            )
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(finishing), REMOTE_PARTS_WAIT_S)
            return checkpoint_id
        return await self._finish(
            projector, controller_epoch, capture, timer, deadline, marked_at, staging_since
        )

    async def _answered(
        self, run: str, request_id: str, wait: bool
    ) -> CheckpointResult | int | None:
        """Request ``request_id`` sent again, refused (``checkpoint_in_progress``): its
        committed (or since expired) checkpoint, or its pending one's id when ``wait=False``;
        None to refuse it (another request's checkpoint is pending, or, ``wait=True``, its own:
        superseded once its requester is gone, as any pending checkpoint)."""
        found = await self.catalog.checkpoint_of_request(run, request_id)
        if found is None or found.status == "aborted":
            return None
        if found.status == "pending":
            return None if wait else found.checkpoint_id
        staging: tuple[str, ...] | None = None
        if found.status == "committed":
            manifest = await self.catalog.load_manifest(run, found.checkpoint_id)
            staging = staging_keys(manifest)
        return CheckpointResult(found, staging, {})

    async def _finish(
        self,
        projector: Projector,
        controller_epoch: int,
        capture: CheckpointCapture,
        timer: StageTimer,
        deadline: float,
        marked_at: float,
        staging_since: int | None = None,
    ) -> CheckpointResult:
        run = projector.run
        checkpoint_id = capture.checkpoint_id
        moved = False
        try:
            await resolve_waits(projector, capture, deadline, deadline)
            timer.stage("waits")
            try:
                if projector.closed.is_set():  # the run's partitions changed owner meanwhile
                    raise LeaseLost(f"the projector of run {run!r} was replaced", run=run)
                committed, delta, restaged = await write_parts(
                    self.catalog,
                    self.replica_id,
                    projector,
                    capture,
                    timer,
                    controller_epoch,
                    marked_at,
                )
            except CheckpointNotPending:  # aborted meanwhile (superseded): say why, below
                committed, delta, restaged = None, None, None
            except LeaseLost:
                # Their new owners' projectors, started afresh, capture the markers and write
                # those parts: the outcome is the catalog's.
                moved = True
                raise
            whole = len(capture.owned) == projector.partitions
            if committed is None:  # other replicas' parts are due: the last one commits
                committed = await self._committed(
                    run, checkpoint_id, controller_epoch, marked_at + deadline
                )
                whole = False
            # Each key once: the keys the whole manifest references, counted as entries change;
            # or only what changed, to a requester holding the base's (a list as long as the
            # live rollouts' keys, encoded, sent and parsed, would cost what is live).
            staging: tuple[str, ...] | None = None
            staged = self._staged.pop(run, None)
            if not whole:  # other replicas wrote parts: the catalog has the whole manifest
                manifest = await self.catalog.load_manifest(run, checkpoint_id)
                staging = staging_keys(manifest)
            elif restaged is None or staging_since != restaged.since or staged != restaged.since:
                staging = tuple(capture.staging)
            timer.stage("commit")
        except LeaseLost:
            self._exports.close(run, capture)
            projector.end_capture(capture, committed=False)
            if not moved:
                await self._abort(projector, controller_epoch, capture, "commit failed")
                raise
            return await self._handed_over(
                run, checkpoint_id, controller_epoch, timer, marked_at + deadline
            )
        except BaseException:
            self._exports.close(run, capture)
            await self._abort(projector, controller_epoch, capture, "commit failed")
            raise
        self._exports.close(run, capture)
        end_committed(projector, capture, delta)
        if whole:
            self._staged[run] = checkpoint_id
            if self._preparer is not None:
                self._preparer.start(projector, capture)
        self._spawn_trim(run)
        return CheckpointResult(
            committed, staging, timer.total(), restaged if staging is None else None
        )

    async def _committed(
        self, run: str, checkpoint_id: int, controller_epoch: int, deadline_at: float
    ) -> Checkpoint:
        """The checkpoint once another writer's part committed it (polled to ``deadline_at``
        plus the grace); ``StaleController`` when a newer controller aborted it, else
        ``unavailable`` (retry) when it was aborted or did not get every part in time."""
        outcome = await self._outcome(run, checkpoint_id, deadline_at)
        if outcome is not None and outcome.status != "aborted":
            return outcome
        if outcome is not None:
            current = (await self.catalog.get_run(run)).controller_epoch
            if current != controller_epoch:
                raise StaleController(
                    f"checkpoint {checkpoint_id} of run {run!r} was aborted: {outcome.reason}",
                    run=run,
                    checkpoint_id=checkpoint_id,
                    controller_epoch=controller_epoch,
                    current_epoch=current,
                )
        raise BackendUnavailable(
            f"checkpoint {checkpoint_id} of run {run!r} "
            + (
                f"was aborted: {outcome.reason}"
                if outcome is not None
                else "did not get every partition's part by its deadline"
            )
            + "; retry",
            run=run,
            checkpoint_id=checkpoint_id,
        )

    async def _handed_over(
        self,
        run: str,
        checkpoint_id: int,
        controller_epoch: int,
        timer: StageTimer,
        deadline_at: float,
    ) -> CheckpointResult:
        """The answer to a requester whose own projector did not capture the markers: the
        checkpoint as the partitions' owners commit it (counts from its row, staging keys from
        its manifest), or why not. Aborted when it is still pending past the grace."""
        try:
            committed = await self._committed(run, checkpoint_id, controller_epoch, deadline_at)
            manifest = await self.catalog.load_manifest(run, checkpoint_id)
        except BaseException:
            with contextlib.suppress(RolloutlogError):
                await self.catalog.abort_checkpoint(
                    run, checkpoint_id, controller_epoch, "its parts did not all come"
                )
            raise
        timer.stage("commit")
        self._staged.pop(run, None)
        self._spawn_trim(run)
        staging = staging_keys(manifest)
        return CheckpointResult(committed, staging, timer.total())

    async def _outcome(self, run: str, checkpoint_id: int, deadline_at: float) -> Checkpoint | None:
        """The checkpoint once it is no longer pending (polled), or None if it still is
        ``grace_s`` past ``deadline_at``."""
        failures = 0
        while True:
            try:
                checkpoint = await self.catalog.get_checkpoint(run, checkpoint_id)
            except RolloutlogError as e:
                if not e.retriable:
                    raise
                failures += 1
                await asyncio.sleep(backoff_s(failures, POLL_S))
                continue
            if checkpoint.status != "pending":
                return checkpoint
            if time.time() >= deadline_at + self.grace_s:
                return None
            await asyncio.sleep(POLL_S)

    async def _remote(self, projector: Projector, capture: CheckpointCapture) -> None:
        """This replica's part of a checkpoint another replica requested: wait for the owned
        partitions' markers and waits (to the checkpoint's deadline), write the parts, learn
        the outcome (committed by this write, or polled) for ``end_capture``."""
        run, checkpoint_id = projector.run, capture.checkpoint_id
        met_at = time.time()  # its first marker here: when the checkpoint was marked, near enough
        delta: Delta | None = None
        committed = False
        try:
            pending = await self.catalog.get_checkpoint(run, checkpoint_id)
            if pending.status != "pending":
                return
            deadline = pending.deadline_s or DEFAULT_WAIT_DEADLINE_S
            deadline_at = pending.requested_at + deadline
            async with asyncio.timeout(max(0.0, deadline_at - time.time())):
                await capture.reached.wait()
            if capture.waiting:
                self._exports.open(projector, capture, deadline_at)
            await resolve_waits(projector, capture, deadline, deadline_at - time.time())
            if projector.closed.is_set():  # replaced: the new projector captures its own
                return
            # A projector started while the checkpoint was pending (its partitions changed
            # owner) may own partitions whose former owner wrote their parts already.
            written = await self.catalog.written_parts(run, checkpoint_id)
            done, delta, _ = await write_parts(
                self.catalog,
                self.replica_id,
                projector,
                capture,
                StageTimer(),
                None,
                met_at,
                written,
            )
            if done is None:
                done = await self._outcome(run, checkpoint_id, deadline_at + self.grace_s)
            # Parts of two projectors' making: the next manifest is written whole, not amended.
            committed = (
                done is not None
                and done.status in ("committed", "expired")
                and not written & capture.owned
            )
        except TimeoutError:
            logger.warning(
                "run %s: checkpoint %d's markers did not all reach this replica's projector by "
                "the deadline: no part from here",
                run,
                checkpoint_id,
            )
        except RolloutlogError as e:
            logger.warning("run %s: part of checkpoint %d: %s", run, checkpoint_id, e.message)
        finally:
            self._exports.close(run, capture)
            if committed:
                end_committed(projector, capture, delta)
            else:
                projector.end_capture(capture, committed=False)

    async def sweep(self) -> None:
        """Forever: abort the checkpoints pending ``2 * grace_s`` past their deadline."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            with contextlib.suppress(RolloutlogError):
                for run, checkpoint_id in await self.catalog.abort_overdue_checkpoints(
                    DEFAULT_WAIT_DEADLINE_S, 2 * self.grace_s
                ):
                    logger.warning(
                        "aborted checkpoint %d of run %s: pending past its deadline",
                        checkpoint_id,
                        run,
                    )

    async def pending_exports(
        self, run: str, participant: str, wait_s: float
    ) -> dict[str, Any] | None:
        """The pending checkpoint's ``checkpoint`` sessions of ``participant`` still waiting for
        their export, once there are any (a long poll of up to ``wait_s``), or None."""
        return await self._exports.wait_for(run, participant, wait_s)

    async def _abort(
        self,
        projector: Projector,
        controller_epoch: int,
        capture: CheckpointCapture,
        reason: str,
    ) -> None:
        run, checkpoint_id = projector.run, capture.checkpoint_id
        projector.end_capture(capture, committed=False)
        try:
            await self.catalog.abort_checkpoint(run, checkpoint_id, controller_epoch, reason)
        except RolloutlogError as e:
            if not e.retriable:  # the original failure matters more
                logger.exception("could not abort checkpoint %d of run %s", checkpoint_id, run)
                return
            # Left pending, it would refuse every later checkpoint of the run until a restart.
            logger.warning(
                "checkpoint %d of run %s could not be aborted yet (%s); retrying until the "
                "catalog takes it",
                checkpoint_id,
                run,
                e.message,
            )
            self._spawn(self._abort_until_landed(run, checkpoint_id, controller_epoch, reason))
        except Exception:  # as above; start-up aborts it otherwise
            logger.exception("could not abort checkpoint %d of run %s", checkpoint_id, run)

    async def _abort_until_landed(
        self, run: str, checkpoint_id: int, controller_epoch: int, reason: str
    ) -> None:
        """Retry a failed checkpoint's abort with jittered backoff until the catalog takes it."""
        failures = 0
        while True:
            failures += 1
            await asyncio.sleep(backoff_s(failures, 0.5))
            try:
                await self.catalog.abort_checkpoint(run, checkpoint_id, controller_epoch, reason)
            except RolloutlogError as e:
                if e.retriable:
                    continue
                # Committed after all (its reply was lost), or a new controller's take-over
                # aborted it: either way it no longer blocks the run.
                logger.info("checkpoint %d of run %s: %s", checkpoint_id, run, e.message)
                return
            logger.info(
                "aborted checkpoint %d of run %s after %d attempts", checkpoint_id, run, failures
            )
            return

    async def _trim(self, run: str) -> None:
        """Drop log records no retained checkpoint needs (where the backend can)."""
        retained = await self.catalog.list_checkpoints(run, status="committed", limit=100)
        if not retained:
            return
        floor: dict[int, int] = {}
        for checkpoint in retained:
            full = await self.catalog.get_checkpoint(run, checkpoint.checkpoint_id)
            for partition, needed in replay_start(full.offsets).items():
                floor[partition] = min(floor.get(partition, needed), needed)
        # Only partitions whose floor rose: a trim is a write (the embedded log's writer queue,
        # behind the appends), and a live rollout that stays put holds its partition's floor.
        trimmed = self._trimmed.setdefault(run, {})
        for partition, before in floor.items():
            if before <= trimmed.get(partition, 0):
                continue
            if not await self.log.trim(run, partition, before):
                return
            trimmed[partition] = before
