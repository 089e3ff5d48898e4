"""What a pending checkpoint waits for, beside ``_checkpointer.py``: its owned partitions'
markers (``reach_markers``) and its open wait steps (``resolve_waits``), the causes of the waits
still open at its deadline, and the export requests of export-on-checkpoint sessions that the
participants' long polls read (``GET …/checkpoints/pending/exports``)."""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import Sequence
from typing import Any

from rolloutlog.core import not_exported_reason, wait_expired_reason
from rolloutlog.log import capture_key
from rolloutlog.projections._capture import CheckpointCapture
from rolloutlog.projections._projector import Projector

__all__ = ["ExportRequests", "name_expired_waits", "reach_markers", "resolve_waits"]


def name_expired_waits(projector: Projector, capture: CheckpointCapture, deadline: float) -> None:
    """The reason of each episode whose waits outlived the deadline: which steps, whose; which
    sessions were not exported."""
    for episode, (owners, _) in capture.waiting.items():
        tracker = projector.trackers.get(episode)
        if tracker is None:
            continue
        reasons = []
        steps = owners & set(tracker.open_waits)
        if steps:
            reasons.append(
                wait_expired_reason(steps, tracker.boundaries, tracker.sessions, deadline)
            )
        missing = tracker.export_missing(owners, capture.checkpoint_id)
        if missing:
            reasons.append(not_exported_reason(missing, capture.checkpoint_id))
        if reasons:
            capture.reasons[episode] = "; ".join(reasons)


class ExportRequests:
    """Per run, the pending checkpoint that waits for exports of ``checkpoint`` sessions, and the
    participants' long polls for them (``GET …/checkpoints/pending/exports``)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[Projector, CheckpointCapture, float]] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def open(self, projector: Projector, capture: CheckpointCapture, deadline_at: float) -> None:
        self._pending[projector.run] = (projector, capture, deadline_at)
        self._wake(projector.run)

    def close(self, run: str, capture: CheckpointCapture) -> None:
        found = self._pending.get(run)
        if found is not None and found[1] is capture:
            del self._pending[run]
            self._wake(run)

    def _wake(self, run: str) -> None:
        event = self._changed.pop(run, None)
        if event is not None:
            event.set()

    def sessions(self, run: str, participant: str) -> dict[str, Any] | None:
        found = self._pending.get(run)
        if found is None:
            return None
        projector, capture, deadline_at = found
        sessions = []
        for episode, (owners, _) in list(capture.waiting.items()):
            tracker = projector.trackers.get(episode)
            if tracker is None:
                continue
            for sid in tracker.export_missing(owners, capture.checkpoint_id):
                view = tracker.sessions.get(sid)
                if view is not None and view.participant == participant:
                    sessions.append(
                        {
                            "episode": episode,
                            "attempt": tracker.attempt,
                            "capture_key": capture_key(episode, tracker.attempt),
                            "session_id": sid,
                        }
                    )
        if not sessions:
            return None
        return {
            "checkpoint_id": capture.checkpoint_id,
            "deadline_at": deadline_at,
            "sessions": sessions,
        }

    async def wait_for(self, run: str, participant: str, wait_s: float) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while True:
            found = self.sessions(run, participant)
            remaining = until - loop.time()
            if found is not None or remaining <= 0:
                return found
            event = self._changed.setdefault(run, asyncio.Event())
            try:
                # Woken by a checkpoint that opens or ends; polled meanwhile, since an export
                # that arrives changes what is missing without a wake-up.
                async with asyncio.timeout(min(remaining, 0.5)):
                    await event.wait()
            except TimeoutError:
                pass


async def reach_markers(projector: Projector, capture: CheckpointCapture, timeout_s: float) -> bool:
    """Wait until the projector captured the markers in every partition it owns (True), or
    gave the capture up (False): it was stopped for another one (the run's partitions changed
    owner), or a newer capture replaced this one. ``unavailable`` past ``timeout_s``."""
    events = (capture.reached, capture.ended, projector.closed)
    if await _first_set(events, timeout_s):
        return capture.reached.is_set()
    # Not there in time: a degraded projector, or one catching up with a long log.
    raise projector.not_reached(f"the markers of checkpoint {capture.checkpoint_id}", timeout_s)


async def resolve_waits(
    projector: Projector, capture: CheckpointCapture, deadline: float, wait_s: float
) -> None:
    """Wait up to ``wait_s`` for the capture's wait steps; then the rest restart (``deadline``
    names the checkpoint's deadline in their reasons). A capture a newer checkpoint replaced
    meanwhile (this one was aborted) waits no more: its parts are refused; nor does one whose
    projector was stopped (the partitions changed owner: the new owners' capture waits)."""
    events = (capture.resolved, capture.ended, projector.closed)
    if capture.waiting and not await _first_set(events, wait_s):
        name_expired_waits(projector, capture, deadline)
        capture.expire_waits(f"its wait step did not reach a boundary in {deadline} s")


async def _first_set(events: Sequence[asyncio.Event], timeout_s: float) -> bool:
    """Wait until one of ``events`` is set (True), or ``timeout_s`` passed with none (False)."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=max(0.0, timeout_s), return_when=FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    return any(event.is_set() for event in events)
