"""What the projector does for a restore: it registers the restore before its
``attempt.started`` records are written, holds its partitions at those records until the
verdict, then applies the restore's resets to its trackers at once (``end_restore``); and it
pins the trackers a plan takes its cut states from (``pin_cut_states``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import EpisodeProjection
from rolloutlog.log import partition_for
from rolloutlog.projections._tracker import EpisodeTracker

__all__ = ["RestoreReset", "RestoreResets"]


@dataclass(frozen=True, slots=True)
class RestoreReset:
    """What a committed restore does to one episode's tracker."""

    action: str  # continue | restart | excluded
    attempt: int
    projection: EpisodeProjection | None = None
    #: Instead of a projection: the episode's tracker, pinned at the cut (``pin_cut_states``).
    pinned: EpisodeTracker | None = None


class RestoreResets:
    """Restores as the projector applies them, a part of ``Projector`` (which calls
    ``_after_verdict`` and ``_on_attempt_started`` for the ``attempt.started`` records it
    applies)."""

    if TYPE_CHECKING:  # the projector's, which this part reads
        partitions: int
        trackers: dict[str, EpisodeTracker]
        retired: set[str]
        committed_restores: set[int]
        _dirty: list[set[str]]
        _captured: dict[int, Mapping[str, int]]

        def _forget(self, episode: str) -> None: ...

        def _tracker(self, episode: str, partition: int) -> EpisodeTracker: ...

    def _init_restores(self) -> None:
        #: Committed restores whose resets this projector applied itself (``end_restore``).
        self._applied_restores: set[int] = set()
        self._pinned: list[EpisodeTracker] = []
        #: Whose plan pinned ``_pinned`` (one restore at a time), and per in-flight restore the
        #: holder of the pins it planned with.
        self._pin_holder: object | None = None
        self._pins_of: dict[int, object] = {}
        self._inflight_restores: dict[int, asyncio.Future[bool]] = {}
        self._restore_resets: dict[int, dict[str, RestoreReset] | None] = {}

    # -- restores --------------------------------------------------------------------------

    def begin_restore(
        self,
        restore_id: int,
        resets: Mapping[str, RestoreReset] | None,
        pins: object | None = None,
    ) -> None:
        """Register a restore before its ``attempt.started`` records are written (``pins``:
        the holder of the trackers its plan pinned, released when it ends). With ``resets``
        None (a restore that was planning when the projector started), only its verdict is
        awaited: if it commits, its records fence their episodes as they are met."""
        if restore_id not in self._inflight_restores:
            self._inflight_restores[restore_id] = asyncio.get_running_loop().create_future()
        # A copy: ``reset_some`` takes them out as it applies them.
        self._restore_resets[restore_id] = None if resets is None else dict(resets)
        if pins is not None:
            self._pins_of[restore_id] = pins

    @property
    def pending_restores(self) -> list[int]:
        """Restores registered whose verdict is still out."""
        return list(self._inflight_restores)

    def end_restore(self, restore_id: int, committed: bool) -> None:
        """The restore's catalog transaction committed (or failed): apply its resets at once (old
        attempts' later records are fenced by the new attempt, and the new attempt writes nothing
        before its ``attempt.started``), then release the partitions waiting for the verdict."""
        future = self._inflight_restores.pop(restore_id, None)
        resets = self._restore_resets.pop(restore_id, None)
        pins = self._pins_of.pop(restore_id, None)
        if committed:
            self.committed_restores.add(restore_id)
        if committed and resets is not None:
            self._applied_restores.add(restore_id)
            with collector_paused():
                for episode, reset in resets.items():
                    self._reset(episode, reset)
        if pins is not None:
            self.release_pins(pins)
        if future is not None and not future.done():
            future.set_result(committed)

    def retire_excluded(self, restore_id: int) -> None:
        """Apply a committed restore's exclusions ahead of its other resets (``reset_some``):
        an excluded episode takes no more events once the restore's reply is out (the append
        path asks ``retired``)."""
        resets = self._restore_resets.get(restore_id) or {}
        for episode in [e for e, r in resets.items() if r.action == "excluded"]:
            self._reset(episode, resets.pop(episode))

    def reset_some(self, restore_id: int, count: int) -> bool:
        """Apply up to ``count`` more of a committed restore's resets ahead of its
        ``end_restore`` (which applies the rest), so that applying them lets the event loop run
        between slices; its partitions wait for the verdict meanwhile. Whether any are left."""
        resets = self._restore_resets.get(restore_id)
        with collector_paused():
            for _ in range(count):
                if not resets:
                    return False
                self._reset(*resets.popitem())
        return bool(resets)

    def _reset(self, episode: str, reset: RestoreReset) -> None:
        if reset.action == "excluded":
            self._forget(episode)
            self.retired.add(episode)
            return
        tracker = self._tracker(episode, partition_for(episode, self.partitions))
        self._dirty[tracker.partition].add(episode)
        if reset.action == "continue" and reset.pinned is not None:
            tracker.continue_at_cut(reset.attempt)
        elif reset.action == "continue" and reset.projection is not None:
            tracker.continue_from(reset.projection, reset.attempt)
        else:
            tracker.restart(reset.attempt)

    def pin_cut_states(
        self, checkpoint_id: int, entries: Iterable[ManifestEntry], holder: object
    ) -> dict[str, EpisodeTracker]:
        """The trackers of the ``continue`` entries that have not changed since this projector
        captured the checkpoint (and are exactly the fold's state), pinned for ``holder``: their
        state at the cut stays readable (``pinned_state``) until ``release_pins(holder)`` (or
        the end of the restore it began with them). A restore takes their verdicts from these
        instead of replaying their records. None while another holder's pins are held (two
        restores of a run planned at once: the later one replays)."""
        versions = self._captured.get(checkpoint_id)
        if versions is None or self._pinned:  # (its entries' versions: a continue's is the cut's)
            return {}
        trackers = self.trackers
        out: dict[str, EpisodeTracker] = {}
        for entry in entries:
            tracker = trackers.get(entry.episode)
            if tracker is not None and tracker.at_cut_of(entry, versions):
                tracker.pin()
                out[entry.episode] = tracker
        self._pinned.extend(out.values())
        if out:
            self._pin_holder = holder
        return out

    def release_pins(self, holder: object | None) -> None:
        """The restore (or plan) that pinned trackers for ``holder`` ended (committed or not)."""
        if holder is None or holder is not self._pin_holder:
            return
        for tracker in self._pinned:
            tracker.unpin()
        self._pinned.clear()
        self._pin_holder = None

    async def _after_verdict(
        self, partition: int, meta: dict[str, Any], verdict: asyncio.Future[bool]
    ) -> None:
        if await verdict and meta["episode"] not in self.retired:
            self._on_attempt_started(partition, meta)

    def _on_attempt_started(self, partition: int, meta: dict[str, Any]) -> None:
        """A committed restore's record (excluded episodes are retired before this)."""
        tracker = self._tracker(meta["episode"], partition)
        # The restore's own resets were applied when it committed (``end_restore``); what is left
        # is a restore seen while catching up after a restart (the start-up refold handles it).
        tracker.fence_to(meta["attempt"])
        self._dirty[partition].add(meta["episode"])
