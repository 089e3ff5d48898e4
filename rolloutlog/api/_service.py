"""The service's state behind the routes: log, catalog, coordinator, fencing caches, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutlog.api._metrics import Counter, Gauge, Histogram, Labels, Registry
from rolloutlog.api._prepare import Preparer
from rolloutlog.api._settings import Settings
from rolloutlog.catalog import Catalog, open_catalog
from rolloutlog.errors import BackendUnavailable
from rolloutlog.log import Log, open_log
from rolloutlog.projections import Coordinator

__all__ = ["Metrics", "RunFencing", "Service"]

logger = logging.getLogger("rolloutlog.api")

#: A participant id missing from the epoch cache reloads it from the catalog at most this often
#: (another replica may have registered it).
EPOCH_REFRESH_S = 1.0


class Metrics:
    """The service's Prometheus series."""

    def __init__(self, service: Service) -> None:
        self.registry = Registry()
        add = self.registry.add
        self.appends = add(Counter("rolloutlog_appends_total", "Append requests that succeeded."))
        self.events = add(Counter("rolloutlog_append_events_total", "Events appended over HTTP."))
        self.bytes = add(Counter("rolloutlog_append_bytes_total", "Request bytes of appends."))
        self.append_latency = add(
            Histogram(
                "rolloutlog_append_latency_seconds",
                "Time to validate, fence and durably append one request.",
            )
        )
        self.checkpoint_duration = add(
            Histogram(
                "rolloutlog_checkpoint_duration_seconds",
                "Checkpoint durations by stage and outcome.",
                ("stage", "outcome"),
            )
        )
        self.restore_duration = add(
            Histogram(
                "rolloutlog_restore_duration_seconds",
                "Restore durations by stage and outcome.",
                ("stage", "outcome"),
            )
        )
        self.refusals = add(
            Counter("rolloutlog_refusals_total", "Requests refused, by error code.", ("code",))
        )
        add(
            Gauge(
                "rolloutlog_live_episodes",
                "Episodes the projector tracks that have not finished.",
                service.live_episodes,
                ("run",),
            )
        )
        add(
            Gauge(
                "rolloutlog_projector_events_applied",
                "Records the projector has applied since the service started.",
                service.events_applied,
                ("run",),
            )
        )
        add(
            Gauge(
                "rolloutlog_inflight_appends",
                "Append requests being processed.",
                lambda: [((), float(service.inflight))],
            )
        )

    def stages(self, histogram: Histogram, timings_ms: dict[str, float], outcome: str) -> None:
        for stage, ms in timings_ms.items():
            histogram.observe(ms / 1000.0, (stage, outcome))


@dataclass
class RunFencing:
    """What the append path checks per run: current attempts and registered epochs."""

    attempts: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    epochs_loaded_at: float = 0.0


class Service:
    """One per app: opened by the lifespan, closed after in-flight appends drain."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.log: Log = open_log(settings.resolved_log_url)
        self.catalog: Catalog = open_catalog(
            settings.resolved_catalog_url, keep_committed=settings.keep_committed
        )
        self.coordinator = Coordinator(self.log, self.catalog)
        self.metrics = Metrics(self)
        self.preparer = Preparer(settings.validation_workers)
        self.fencing: dict[str, RunFencing] = {}
        self._fencing_locks: dict[str, asyncio.Lock] = {}
        self.inflight = 0
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

    def begin_append(self) -> None:
        if self.draining:
            raise BackendUnavailable("the service is shutting down; retry against another one")
        self.inflight += 1
        self._drained.clear()

    def end_append(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._drained.set()

    # -- fencing caches ----------------------------------------------------------------------

    async def run_fencing(self, run: str) -> RunFencing:
        """The run's fencing state, loaded from the catalog on first use."""
        fencing = self.fencing.get(run)
        if fencing is not None:
            return fencing
        lock = self._fencing_locks.setdefault(run, asyncio.Lock())
        async with lock:
            fencing = self.fencing.get(run)
            if fencing is None:
                await self.coordinator.projector(run)  # UnknownRun when there is no such run
                fencing = RunFencing(attempts=await self.catalog.current_attempts(run))
                await self._load_epochs(run, fencing)
                self.fencing[run] = fencing
            return fencing

    async def _load_epochs(self, run: str, fencing: RunFencing) -> None:
        participants = await self.catalog.list_participants(run)
        for participant in participants:
            known = fencing.epochs.get(participant.participant_id, 0)
            fencing.epochs[participant.participant_id] = max(known, participant.epoch)
        fencing.epochs_loaded_at = time.monotonic()

    async def refresh_epochs(self, run: str, fencing: RunFencing) -> None:
        """Reload registered epochs (rate-limited): a participant may have registered elsewhere."""
        if time.monotonic() - fencing.epochs_loaded_at >= EPOCH_REFRESH_S:
            fencing.epochs_loaded_at = time.monotonic()
            await self._load_epochs(run, fencing)

    def current_attempt(self, run: str, fencing: RunFencing, episode: str) -> int:
        """The episode's current attempt: the catalog's (kept up to date by this service's
        restores) or, if higher, what the projector has seen in the log (another replica's)."""
        attempt = fencing.attempts.get(episode, 0)
        projector = self.coordinator.projectors.get(run)
        if projector is not None:
            tracker = projector.trackers.get(episode)
            if tracker is not None and tracker.attempt > attempt:
                return tracker.attempt
        return attempt

    def note_epoch(self, run: str, participant_id: str, epoch: int) -> None:
        fencing = self.fencing.get(run)
        if fencing is not None:
            fencing.epochs[participant_id] = max(fencing.epochs.get(participant_id, 0), epoch)

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

    # -- gauges ------------------------------------------------------------------------------

    def live_episodes(self) -> list[tuple[Labels, float]]:
        return [
            ((run,), float(projector.live_episodes()))
            for run, projector in list(self.coordinator.projectors.items())
        ]

    def events_applied(self) -> list[tuple[Labels, float]]:
        return [
            ((run,), float(projector.events_applied))
            for run, projector in list(self.coordinator.projectors.items())
        ]
