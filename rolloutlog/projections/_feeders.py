"""The catalog's feeders: per run, background tasks that record what its projector saw (episode
starts and finishes for analysts, quarantined records) in the catalog, in batches. The projector
never waits for them: while the catalog is down their batches stay queued."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Sequence

from rolloutlog.catalog import Catalog, EpisodeFinish, EpisodeStart, QuarantinedRecord
from rolloutlog.errors import RolloutlogError
from rolloutlog.projections._timing import backoff_s

logger = logging.getLogger(__name__)

__all__ = ["Unrecorded", "flush_episodes", "record_episodes", "record_quarantine"]

#: The episode records' last flush on the way out waits at most this for the catalog.
_LAST_FLUSH_S = 5.0
#: Starts and finishes per catalog write: small enough that a checkpoint's writes, which go
#: before the feeder's next batch, wait a few milliseconds for the one being written (S4).
_EPISODE_BATCH = 1000
#: Quarantined records per catalog write.
_QUARANTINE_BATCH = 1000
#: One batch of a projector's episodes written at a time: a flush that must see every finish
#: recorded (a checkpoint's, a restore's, the results routes') waits for the batch another one
#: is writing, not for all of that flush's batches (the lock is taken per batch, in order).
_FLUSHING: weakref.WeakKeyDictionary[Unrecorded, asyncio.Lock] = weakref.WeakKeyDictionary()


async def record_quarantine(catalog: Catalog, projector: Unrecorded, every_s: float = 1.0) -> None:
    """Record the projector's quarantined records in the catalog, in batches; a batch the
    catalog refuses (it is down) stays and is tried again (the projector never waits)."""
    try:
        while True:
            await asyncio.sleep(every_s)
            await _flush_quarantine(catalog, projector)
    finally:
        with contextlib.suppress(Exception):
            await _flush_quarantine(catalog, projector)


async def _flush_quarantine(catalog: Catalog, projector: Unrecorded) -> None:
    while batch := projector.new_quarantine_batch(_QUARANTINE_BATCH):
        try:
            await catalog.quarantine(projector.run, batch)
        except Exception as e:  # the catalog is down: keep the batch for the next tick
            logger.warning(
                "could not record %d quarantined record(s) of run %s: %s",
                len(batch),
                projector.run,
                e,
            )
            return
        projector.quarantine_recorded(len(batch))


async def record_episodes(catalog: Catalog, projector: Unrecorded, every_s: float = 1.0) -> None:
    """Feed the catalog's episodes table (for analysts) from the projector, in batches.

    While the catalog is unavailable the batches stay queued and are retried with jittered
    backoff: an episode that finishes during an outage must not stay ``running`` for good.
    """
    failures = 0
    try:
        while True:
            await asyncio.sleep(backoff_s(failures, every_s) if failures else every_s)
            try:
                await flush_episodes(catalog, projector)
            except RolloutlogError as e:  # retriable: the batch is kept
                failures += 1
                if failures == 1:
                    logger.warning(
                        "could not record episodes of run %s; retrying until the catalog "
                        "takes them: %s",
                        projector.run,
                        e.message,
                    )
                continue
            if failures:
                logger.info(
                    "recorded the episodes of run %s after %d failed attempts",
                    projector.run,
                    failures,
                )
            failures = 0
    finally:
        # Last flush on the way out, bounded: a hung catalog must not hold up the stop.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_LAST_FLUSH_S):
                await flush_episodes(catalog, projector)


async def flush_episodes(
    catalog: Catalog, projector: Unrecorded, *, finishes_only: bool = False
) -> None:
    """Record the projector's new starts and finishes (with the results of the finishes). A
    retriable catalog error keeps the batch queued and is raised; any other error drops that
    batch (the catalog refused it). When it returns, every finish the projector had folded
    before the call is in the catalog. ``finishes_only`` leaves the starts to the feeder: a
    checkpoint, a restore and the results routes need the finishes only, and a burst of new
    episodes' starts would lengthen them."""
    lock = _FLUSHING.get(projector)
    if lock is None:
        lock = _FLUSHING[projector] = asyncio.Lock()
    while True:
        async with lock:
            if not (projector.new_finishes if finishes_only else projector.has_new_episodes()):
                return
            await _flush_batch(catalog, projector, finishes_only)


async def _flush_batch(catalog: Catalog, projector: Unrecorded, finishes_only: bool) -> None:
    starts, finishes = projector.take_new_episodes(_EPISODE_BATCH)
    if finishes_only:
        projector.put_back_new_episodes(starts, ())
        starts = []
    done = False
    try:
        await catalog.record_episodes(projector.run, starts, finishes)
        done = True
    except Exception as e:
        if isinstance(e, RolloutlogError) and e.retriable:
            raise
        done = True  # dropped: retrying what the catalog refuses would block the run
        logger.exception("the catalog refused episodes of run %s", projector.run)
    finally:
        if not done:
            # Unavailable, or cancelled mid-write: back in front, in order (the projector
            # may have queued more meanwhile). Sending a batch again whose commit did land
            # is harmless: starts keep the first position, finishes are idempotent.
            projector.put_back_new_episodes(starts, finishes)


class Unrecorded:
    """What a projector folded that the catalog has not recorded yet, a part of ``Projector``
    (which queues it as it applies records): what the feeders take."""

    #: The run (the projector's).
    run: str

    def _init_unrecorded(self) -> None:
        #: Starts and finishes not yet recorded in the catalog's episodes table (for analysts).
        self.new_starts: list[EpisodeStart] = []
        self.new_finishes: list[EpisodeFinish] = []
        #: Quarantined records not yet recorded in the catalog.
        self.new_quarantined: list[QuarantinedRecord] = []

    def has_new_episodes(self) -> bool:
        return bool(self.new_starts or self.new_finishes)

    def take_new_episodes(self, limit: int) -> tuple[list[EpisodeStart], list[EpisodeFinish]]:
        """Up to ``limit`` starts and finishes not yet recorded, oldest first (taken off the
        queue: ``put_back_new_episodes`` if the catalog did not take them)."""
        starts, self.new_starts = self.new_starts[:limit], self.new_starts[limit:]
        finishes, self.new_finishes = self.new_finishes[:limit], self.new_finishes[limit:]
        return starts, finishes

    def put_back_new_episodes(
        self, starts: Sequence[EpisodeStart], finishes: Sequence[EpisodeFinish]
    ) -> None:
        """Back in front of the queue, in order (more may have been queued meanwhile)."""
        self.new_starts[:0] = starts
        self.new_finishes[:0] = finishes

    def new_quarantine_batch(self, limit: int) -> list[QuarantinedRecord]:
        """Up to ``limit`` quarantined records not yet recorded (``quarantine_recorded`` once
        the catalog took them)."""
        return self.new_quarantined[:limit]

    def quarantine_recorded(self, count: int) -> None:
        del self.new_quarantined[:count]

    def drop_unrecorded(self) -> None:
        """The run is deleted: nothing more for the catalog."""
        self.new_starts.clear()
        self.new_finishes.clear()
        self.new_quarantined.clear()
