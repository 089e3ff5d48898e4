"""The service's state behind the routes: log, catalog, coordinator, fencing caches, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutlog.api._bodies import BodyMeter, slowest
from rolloutlog.api._metrics import Metrics
from rolloutlog.api._prepare import Preparer
from rolloutlog.api._settings import Settings
from rolloutlog.catalog import Catalog, open_catalog
from rolloutlog.errors import BackendUnavailable
from rolloutlog.log import Log, open_log
from rolloutlog.projections import DEFAULT_LEASE_S, Coordinator

__all__ = ["RunFencing", "Service"]

logger = logging.getLogger("rolloutlog.api")


class _Refresh:
    """A single-flight reload: ``fresh(since)`` returns once a load that *began* at or after
    ``since`` has finished, joining one in flight when it began late enough. A refusal waits for
    one, so that a registration or restore committed on another replica before the request's
    check is seen; concurrent requests share one catalog query."""

    def __init__(self, load: Callable[[], Awaitable[None]]) -> None:
        self._load = load
        self._task: asyncio.Task[None] | None = None
        self.loaded_at = float("-inf")

    async def fresh(self, since: float) -> None:
        while self.loaded_at < since:
            if self._task is None:
                self._task = asyncio.create_task(self._run(time.monotonic()))
                # Its waiters may all be gone (clients disconnected): retrieve its outcome anyway.
                self._task.add_done_callback(lambda task: task.cancelled() or task.exception())
            await asyncio.shield(self._task)

    async def _run(self, started: float) -> None:
        try:
            await self._load()
            self.loaded_at = max(self.loaded_at, started)
        finally:
            self._task = None


@dataclass
class RunFencing:
    """What the append path checks per run: current attempts, registered epochs, and the highest
    ``seq`` per participant epoch (what ``max_seq_gap`` is measured from)."""

    attempts: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)
    epochs_refresh: _Refresh | None = None
    attempts_refresh: _Refresh | None = None


class Service:
    """One per app: opened by the lifespan, closed after in-flight appends drain."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.log: Log = open_log(settings.resolved_log_url, **settings.log_options)
        self.catalog: Catalog = open_catalog(
            settings.resolved_catalog_url, keep_committed=settings.keep_committed
        )
        self.coordinator = Coordinator(
            self.log,
            self.catalog,
            replica_id=settings.replica_id,
            address=settings.address,
            lease_s=settings.lease_s or DEFAULT_LEASE_S,
        )
        self.metrics = Metrics(self.coordinator, lambda: self.inflight)
        self.preparer = Preparer(settings.validation_workers)
        self.fencing: dict[str, RunFencing] = {}
        # Epochs registered here before the run's fencing state was first loaded.
        self._new_epochs: dict[str, set[tuple[str, int]]] = {}
        self._fencing_locks: dict[str, asyncio.Lock] = {}
        self.inflight = 0
        #: The bodies of the appends in flight, oldest first.
        self._slots: dict[BodyMeter, None] = {}
        self.draining = False
        self._drained = asyncio.Event()
        self._drained.set()

    async def start(self) -> None:
        if self.settings.resolved_log_url.startswith("embedded://"):
            data_dir = Path(self.settings.data_dir)
            await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
        await self.log.start()
        await self.preparer.start()
        try:
            await self.catalog.start()
            try:
                await self.coordinator.start()
            except BaseException:
                await self.catalog.stop()
                raise
        except BaseException:
            await self.preparer.stop()
            await self.log.close()
            raise
        logger.info(
            "service started",
            extra={"log": self.log.url, "catalog": self.catalog.backend},
        )

    async def stop(self) -> None:
        """Refuse new appends, wait for in-flight ones, then close everything."""
        self.draining = True
        if self.inflight:
            logger.info("draining in-flight appends", extra={"inflight": self.inflight})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.drain_timeout_s):
                    await self._drained.wait()
        try:
            await self.coordinator.stop()
        finally:
            try:
                await self.catalog.stop()
            finally:
                await self.log.close()
                await self.preparer.stop()
        logger.info("service stopped")

    # -- in-flight appends -------------------------------------------------------------------

    def begin_append(self, meter: BodyMeter | None = None) -> None:
        """Take an append slot for the request whose body ``meter`` measures; when every slot is
        taken, the slot of the slowest body below the minimum rate (``_bodies``), else
        ``503``."""
        if self.draining:
            raise BackendUnavailable("the service is shutting down; retry against another one")
        limit = self.settings.max_inflight_appends
        min_rate = self.settings.min_body_rate
        if self.inflight >= limit and meter is not None and min_rate:
            now = asyncio.get_running_loop().time()
            victim = slowest(self._slots, min_rate, now)
            if victim is not None:
                del self._slots[victim]
                victim.released = True
                victim.evict()
                self.inflight -= 1
        if self.inflight >= limit:
            # Refused at once rather than queued: a queue would hold the bodies' memory anyway,
            # and the client (the SDK) backs off and retries a 503.
            raise BackendUnavailable(
                f"{self.inflight} appends are in flight, the most this service takes at once; "
                "retry shortly",
                inflight=self.inflight,
                max_inflight_appends=limit,
                retry_after_s=1,
            )
        self.inflight += 1
        self._drained.clear()
        if meter is not None:
            self._slots[meter] = None

    def end_append(self, meter: BodyMeter | None = None) -> None:
        if meter is not None:
            if meter.released:  # its slot went to another append, which counts it
                return
            self._slots.pop(meter, None)
        self.inflight -= 1
        if self.inflight == 0:
            self._drained.set()

    # -- fencing caches ----------------------------------------------------------------------

    async def run_fencing(self, run: str) -> RunFencing:
        """The run's fencing state, loaded from the catalog on first use."""
        # A run whose log lost records refuses appends (run_lost): they would land at offsets
        # its checkpoints already name.
        self.coordinator.check_appendable(run)
        fencing = self.fencing.get(run)
        if fencing is not None:
            return fencing
        lock = self._fencing_locks.setdefault(run, asyncio.Lock())
        async with lock:
            fencing = self.fencing.get(run)
            if fencing is None:
                await self.coordinator.follow(run)  # UnknownRun when there is no such run
                self.coordinator.check_appendable(run)
                fencing = RunFencing(attempts=await self.catalog.current_attempts(run))
                await self._load_epochs(run, fencing)
                for participant in self._new_epochs.pop(run, ()):
                    fencing.seqs.setdefault(participant, 0)
                loaded = fencing

                async def epochs() -> None:
                    await self._load_epochs(run, loaded)

                async def attempts() -> None:
                    self.note_attempts(run, (await self.catalog.current_attempts(run)).items())

                fencing.epochs_refresh = _Refresh(epochs)
                fencing.attempts_refresh = _Refresh(attempts)
                self.fencing[run] = fencing
            return fencing

    async def _load_epochs(self, run: str, fencing: RunFencing) -> None:
        participants = await self.catalog.list_participants(run)
        for participant in participants:
            known = fencing.epochs.get(participant.participant_id, 0)
            fencing.epochs[participant.participant_id] = max(known, participant.epoch)

    async def refresh_epochs(self, fencing: RunFencing, since: float) -> None:
        """Reload registered epochs unless a load began after ``since`` (another replica may have
        registered the participant)."""
        assert fencing.epochs_refresh is not None
        await fencing.epochs_refresh.fresh(since)

    async def refresh_attempts(self, fencing: RunFencing, since: float) -> None:
        """Reload current attempts unless a load began after ``since`` (another replica's
        restore)."""
        assert fencing.attempts_refresh is not None
        await fencing.attempts_refresh.fresh(since)

    def highest_seq(
        self, run: str, fencing: RunFencing, participant: tuple[str, int]
    ) -> int | None:
        """The highest ``seq`` of a participant epoch this service appended, or that the
        projector saw in the log (appends through other replicas or Kafka); None if neither."""
        high = fencing.seqs.get(participant)
        seen = self.coordinator.highest_seq(run, participant)
        if seen is not None and (high is None or seen > high):
            high = seen
        return high

    def note_seqs(self, fencing: RunFencing, seqs: Iterable[tuple[tuple[str, int], int]]) -> None:
        for participant, seq in seqs:
            if seq > fencing.seqs.get(participant, -1):
                fencing.seqs[participant] = seq

    def current_attempt(self, run: str, fencing: RunFencing, episode: str) -> int:
        """The episode's current attempt: the catalog's (kept up to date by this service's
        restores) or, if higher, what the projector has seen in the log (another replica's)."""
        attempt = fencing.attempts.get(episode, 0)
        seen = self.coordinator.current_attempt(run, episode)
        return seen if seen is not None and seen > attempt else attempt

    def excluded(self, run: str, episode: str) -> bool:
        """Whether a restore excluded the episode (the projector ignores its later events)."""
        return self.coordinator.is_retired(run, episode)

    def note_epoch(self, run: str, participant_id: str, epoch: int) -> None:
        # A new epoch counts its seqs from 1: its first event may not jump past max_seq_gap.
        fencing = self.fencing.get(run)
        if fencing is None:
            self._new_epochs.setdefault(run, set()).add((participant_id, epoch))
            return
        fencing.epochs[participant_id] = max(fencing.epochs.get(participant_id, 0), epoch)
        fencing.seqs.setdefault((participant_id, epoch), 0)

    def note_attempts(self, run: str, attempts: Iterable[tuple[str, int]]) -> None:
        fencing = self.fencing.get(run)
        if fencing is not None:
            for episode, attempt in attempts:
                if attempt > fencing.attempts.get(episode, 0):
                    fencing.attempts[episode] = attempt

    def forget_run(self, run: str) -> None:
        """Drop what the service caches of a deleted run (a fresh run may reuse the name)."""
        self.fencing.pop(run, None)
        self._fencing_locks.pop(run, None)
        self._new_epochs.pop(run, None)
