"""The projector's half of a checkpoint: the manifest entries of its partitions' episodes
captured at each marker (``CheckpointCapture``), amending the previous committed capture
(``ManifestBase``) rather than walking every live episode again, with each entry's tracker
version kept (``Versions``) so that a restore can pin what did not change since."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

from rolloutlog._gc import collector_paused
from rolloutlog.catalog import ManifestEntry
from rolloutlog.projections._tracker import EpisodeTracker

__all__ = ["CheckpointCapture", "ManifestBase", "ManifestCapture", "Versions"]

#: How many committed checkpoints' entry versions a projector keeps (retention keeps two).
_CAPTURES_KEPT = 2
#: A checkpoint's ``Versions`` is flattened into one dict after this many layers.
_VERSIONS_DEPTH = 8
#: The longest a new capture waits for the outcome of the one before, whose parts are written.
_OUTCOME_WAIT_S = 5.0


class Versions(Mapping[str, int]):
    """A committed checkpoint's entries' tracker versions (``CheckpointCapture.seen``, whole):
    what its capture changed, laid over the previous checkpoint's. The previous one's stay
    readable as they were (a restore pins its versions, ``Projector.pin_cut_states``) without a
    copy of every live episode's version per checkpoint (64,000 of them took 3-5 ms of each
    checkpoint's manifest stage); every ``_VERSIONS_DEPTH`` layers they are flattened into one
    dict. Only ``get`` is cheap; the rest of ``Mapping`` flattens."""

    __slots__ = ("_depth", "_own", "_parent")

    def __init__(
        self, own: dict[str, int | None], parent: Versions | None = None, depth: int = 0
    ) -> None:
        #: Each changed episode's version, or None: no longer in the manifest.
        self._own = own
        self._parent = parent
        self._depth = depth

    @classmethod
    def over(cls, parent: Mapping[str, int], changes: dict[str, int | None]) -> Versions:
        if isinstance(parent, Versions) and parent._depth < _VERSIONS_DEPTH:
            return cls(changes, parent, parent._depth + 1)
        flat = parent._flat() if isinstance(parent, Versions) else dict(parent)
        for episode, version in changes.items():
            if version is None:
                flat.pop(episode, None)
            else:
                flat[episode] = version
        return cls(cast(dict[str, int | None], flat))

    def get(self, episode: str, default: Any = None) -> Any:
        node: Versions | None = self
        while node is not None:
            version = node._own.get(episode, _ABSENT)
            if version is not _ABSENT:
                return default if version is None else version
            node = node._parent
        return default

    def __getitem__(self, episode: str) -> int:
        version = self.get(episode)
        if version is None:
            raise KeyError(episode)
        return cast(int, version)

    def _flat(self) -> dict[str, int]:
        layers: list[dict[str, int | None]] = []
        node: Versions | None = self
        while node is not None:
            layers.append(node._own)
            node = node._parent
        flat = cast(dict[str, int], dict(layers.pop()))  # the bottom layer holds no None
        for layer in reversed(layers):
            for episode, version in layer.items():
                if version is None:
                    flat.pop(episode, None)
                else:
                    flat[episode] = version
        return flat

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())


_ABSENT = object()
_EPISODE = itemgetter(0)


@dataclass
class CheckpointCapture:
    """The projector's half of one checkpoint: filled in as each partition it owns reaches its
    marker (the other partitions' owners capture theirs)."""

    checkpoint_id: int
    owned: frozenset[int]
    markers: dict[int, int] = field(default_factory=dict)
    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    #: Per partition, the earliest offset a live (continue or restart) episode needs.
    needed: dict[int, int] = field(default_factory=dict)
    #: Why an episode restarts, for those that do.
    reasons: dict[str, str] = field(default_factory=dict)
    #: Episodes whose cut waits for a boundary: episode → (owners awaited, marker offset).
    waiting: dict[str, tuple[set[str], int]] = field(default_factory=dict)
    #: Each entry's tracker version when it was decided (waits that expired are decided by the
    #: clock: absent): an entry stands while its tracker stays at that version (the next
    #: checkpoint keeps it; a restore pins it, see ``Projector.pin_cut_states``).
    seen: dict[str, int] = field(default_factory=dict)
    #: The committed checkpoint this one amends: ``entries`` then hold only the episodes whose
    #: trackers changed since its markers, ``gone`` those of its entries no longer tracked.
    base: ManifestBase | None = None
    gone: list[str] = field(default_factory=list)
    #: Set by ``compose``: the whole manifest, and each of its entries' ``seen`` version.
    whole: dict[str, ManifestEntry] | None = None
    whole_seen: Mapping[str, int] | None = None
    #: The whole manifest's ``continue``/``restart``/``finished`` counts and ``size_bytes``,
    #: and how many of its entries reference each staging key.
    totals: dict[str, int] = field(default_factory=dict)
    staging: dict[str, int] = field(default_factory=dict)

    def compose(self) -> dict[str, ManifestEntry]:
        """The whole manifest: the base's, amended in place by this capture's entries (no
        Python pass over the live episodes; a base whose next checkpoint fails is dropped, see
        ``Projector.end_capture``). ``seen`` is laid over the base's (``Versions``): the base's
        stays as the versions of its own checkpoint (``pin_cut_states``)."""
        if self.whole is not None:
            return self.whole
        base = self.base
        if base is None:
            self.whole, self.whole_seen = self.entries, self.seen
            return self.entries
        whole = base.entries
        whole.update(self.entries)
        changes: dict[str, int | None] = dict(self.seen)
        for episode in self.gone:
            whole.pop(episode, None)
            changes[episode] = None
        for episode in self.entries.keys() - self.seen.keys():  # waits that expired
            changes[episode] = None
        self.whole, self.whole_seen = whole, Versions.over(base.seen, changes)
        return whole

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    resolved: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by ``Projector.end_capture``: the outcome is known.
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def _check(self) -> None:
        if len(self.markers) == len(self.owned):
            self.reached.set()
            if not self.waiting:
                self.resolved.set()

    def expire_waits(self, reason: str) -> None:
        """The deadline passed: every episode still waiting for its boundary restarts."""
        for episode, (_, marker) in list(self.waiting.items()):
            old = self.entries.get(episode)
            if old is not None:
                self.entries[episode] = old._replace(
                    action="restart", cut_offset=marker, staging_keys=()
                )
                self.reasons.setdefault(episode, reason)  # a more precise one may be there
        self.waiting.clear()
        self.resolved.set()


@dataclass(frozen=True, slots=True)
class ManifestBase:
    """The newest checkpoint this projector captured and saw commit: its whole manifest, and
    how its stored manifest is chained (``depth`` deltas since a whole one, ``amended`` entries
    written in those deltas)."""

    checkpoint_id: int
    entries: dict[str, ManifestEntry]
    seen: Mapping[str, int]
    #: Per partition, the ``replay_from`` it committed: a delta keeps the smaller of it and its
    #: changed episodes' first offsets (never above the true one; exact again once whole).
    needed: Mapping[int, int]
    depth: int
    amended: int
    totals: Mapping[str, int]
    staging: dict[str, int]


class ManifestCapture:
    """The capture of manifests at markers, a part of ``Projector`` (which follows the log and
    calls ``_on_marker`` at each marker it applies)."""

    if TYPE_CHECKING:  # the projector's, which this part reads
        partitions: int
        owned: frozenset[int]
        trackers: dict[str, EpisodeTracker]
        by_partition: list[dict[str, EpisodeTracker]]
        retired: set[str]
        caught_up: bool
        _dirty: list[set[str]]
        _open_from: int | None
        _held: set[int]

        def _forget(self, episode: str) -> None: ...

    def _init_captures(self) -> None:
        #: Per committed checkpoint this projector captured: its entries' tracker versions.
        self._captured: dict[int, Mapping[str, int]] = {}
        #: The newest committed capture, which the next checkpoint's manifest amends.
        self._base: ManifestBase | None = None
        self._capture: CheckpointCapture | None = None
        #: The newest checkpoint id this projector has seen a capture or a marker of.
        self._newest_checkpoint = 0
        #: Told of each capture begun at a marker of another replica's checkpoint.
        self.on_remote_capture: Callable[[CheckpointCapture], object] | None = None

    # -- checkpoints -----------------------------------------------------------------------

    def begin_capture(self, checkpoint_id: int) -> CheckpointCapture:
        """Register the checkpoint whose markers are about to be written (or, another replica's,
        whose first marker in an owned partition is being applied). A capture still registered is of
        an older checkpoint that is over (one is pending at a time): it ends uncommitted."""
        if self._capture is not None:
            self.end_capture(self._capture, committed=False)
        capture = CheckpointCapture(checkpoint_id, self.owned, base=self._base)
        capture._check()  # owning no partition, it has reached every marker it will
        self._capture = capture
        self._newest_checkpoint = max(self._newest_checkpoint, checkpoint_id)
        return capture

    def end_capture(
        self, capture: CheckpointCapture, committed: bool, *, depth: int = 0, amended: int = 0
    ) -> None:
        """The checkpoint committed (finished episodes are reported: stop tracking them; its
        manifest is stored ``depth`` deltas after a whole one, ``amended`` entries in those) or
        not (the next manifest is written whole: a commit whose reply was lost may be in the
        catalog all the same). A capture no longer registered (a newer one replaced it) changes
        nothing: the base is the newest capture's business."""
        capture.ended.set()
        if self._capture is not capture:
            return
        self._capture = None
        self._base = None
        if committed:
            whole = capture.whole if capture.whole is not None else capture.compose()
            seen = capture.whole_seen if capture.whole_seen is not None else capture.seen
            self._base = ManifestBase(
                capture.checkpoint_id,
                whole,
                seen,
                dict(capture.needed),
                depth,
                amended,
                capture.totals,
                capture.staging,
            )
            self._captured[capture.checkpoint_id] = seen
            for old in sorted(self._captured)[:-_CAPTURES_KEPT]:
                del self._captured[old]
            for entry in capture.entries.values():
                if entry.action == "finished":
                    self._forget(entry.episode)
                    self.retired.add(entry.episode)

    def committed_manifest(self, checkpoint_id: int) -> list[ManifestEntry] | None:
        """The whole manifest of committed checkpoint ``checkpoint_id`` as the catalog's
        ``load_manifest`` gives it (in episode order), from memory: while it is this projector's
        base (the newest capture it saw commit, not yet amended by a newer capture's
        ``compose``) and the projector owns every partition (its capture wrote every part).
        None otherwise: read it from the catalog."""
        base, capture = self._base, self._capture
        if (
            base is None
            or base.checkpoint_id != checkpoint_id
            or len(self.owned) != self.partitions
            or (capture is not None and capture.whole is not None)
        ):
            return None
        return sorted(base.entries.values(), key=_EPISODE)

    def _on_marker(self, partition: int, offset: int, checkpoint_id: int) -> Awaitable[None] | None:
        """A marker (of an owned partition: others are not captured here). The first one met
        after catching up of a checkpoint newer than any known, with no capture registered for
        it, begins a capture: another replica's checkpoint. While catching up none is captured
        (the refold's buffers make trackers inexact there): the marker of a checkpoint that was
        not over when the start was planned holds its partition there (``_read_to_end`` stops
        short of it, and the follower meets it again caught up); any other is over already. A
        capture still registered whose parts are written waits for its outcome first (returned
        to await): it decides the new capture's base."""
        if partition not in self.owned:
            return None
        capture = self._capture
        newest = self._newest_checkpoint
        if not self.caught_up:
            if self._open_from is not None and checkpoint_id >= self._open_from:
                self._held.add(partition)
            else:
                self._newest_checkpoint = max(newest, checkpoint_id)
            return None
        self._newest_checkpoint = max(newest, checkpoint_id)
        if capture is None or capture.checkpoint_id != checkpoint_id:
            if checkpoint_id <= newest or self.on_remote_capture is None:
                return None  # a marker of a checkpoint that is over (aborted, or stale)
            if capture is not None and capture.resolved.is_set() and not capture.ended.is_set():
                return self._remote_after_outcome(partition, offset, checkpoint_id)
            self._begin_remote(partition, offset, checkpoint_id)
            return None
        self._capture_at(capture, partition, offset)
        return None

    async def _remote_after_outcome(self, partition: int, offset: int, checkpoint_id: int) -> None:
        await self.capture_outcome()
        self._begin_remote(partition, offset, checkpoint_id)

    def _begin_remote(self, partition: int, offset: int, checkpoint_id: int) -> None:
        capture = self.begin_capture(checkpoint_id)
        assert self.on_remote_capture is not None
        self.on_remote_capture(capture)
        self._capture_at(capture, partition, offset)

    def _capture_at(self, capture: CheckpointCapture, partition: int, offset: int) -> None:
        with collector_paused():
            self._capture_partition(capture, partition, offset)
        capture._check()

    async def capture_outcome(self) -> None:
        """Wait (up to ``_OUTCOME_WAIT_S``) for the registered capture, if its parts are written
        (or being written), to learn its outcome: a checkpoint after it amends it only if it
        committed. (One with parts still to write is over: a newer checkpoint began, so it
        aborted; the next capture replaces it.)"""
        capture = self._capture
        if capture is not None and capture.resolved.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_OUTCOME_WAIT_S):
                    await capture.ended.wait()

    def _capture_partition(self, capture: CheckpointCapture, partition: int, offset: int) -> None:
        capture.markers[partition] = offset
        entries = capture.entries
        dirty, self._dirty[partition] = self._dirty[partition], set()
        trackers = self.by_partition[partition]
        base = capture.base
        needed = offset
        pairs: Iterable[tuple[str, EpisodeTracker]] = trackers.items()
        before: Mapping[str, int] = {}
        if base is not None:
            # What changed since the base's markers: the other entries stand (see ``seen``).
            needed = min(offset, base.needed.get(partition, offset))
            before = base.seen
            pairs = [(e, trackers[e]) for e in dirty if e in trackers]
            capture.gone.extend(e for e in dirty if e not in trackers and e in base.entries)
        # One tuple per episode straight from the tracker's fields (``_entry`` inlined: on a
        # first capture this loop runs for every live episode of the partition while the
        # checkpoint waits); the action is the fold's capture rule (``EpisodeFold.at_cut``).
        new, entry_type = tuple.__new__, ManifestEntry
        seen = capture.seen
        for episode, tracker in pairs:
            version = tracker.version
            if before.get(episode) == version:
                continue  # a record it did not admit: its entry stands
            decision = tracker.at_cut()
            if decision is None:
                if base is not None and episode in base.entries:
                    capture.gone.append(episode)
                continue
            action, reason, waits = decision
            if action == "finished":
                entries[episode] = _entry(tracker, action, offset)
                continue
            first = tracker.first_offset
            if first is not None and first < needed:
                needed = first
            if waits:
                capture.waiting[episode] = (
                    set(tracker.open_waits) | tracker.export_owners(),
                    offset,
                )
            else:
                seen[episode] = version
                if reason is not None:
                    capture.reasons[episode] = reason
            entries[episode] = new(
                entry_type,
                (
                    episode,
                    tracker.attempt,
                    action,
                    partition,
                    offset,
                    tracker.last_stage,
                    tracker.staging_keys_at_cut(),
                    tracker.size_bytes,
                    None,  # the reason, from ``capture.reasons`` when the manifest is written
                ),
            )
        capture.needed[partition] = needed

    def _check_wait(self, capture: CheckpointCapture, tracker: EpisodeTracker, offset: int) -> None:
        owners, _ = capture.waiting[tracker.episode]
        if owners & set(tracker.open_waits) or tracker.export_missing(
            owners, capture.checkpoint_id
        ):
            return
        del capture.waiting[tracker.episode]
        # The awaited boundaries came: the capture rule again, the cut just past this record.
        decision = tracker.at_cut(waits=False)
        if decision is None:  # a restore reset it to nothing meanwhile: no entry, as at a marker
            capture.entries.pop(tracker.episode, None)
            base = capture.base
            if base is not None and tracker.episode in base.entries:
                capture.gone.append(tracker.episode)
        else:
            action, reason, _ = decision
            if reason is not None:
                capture.reasons[tracker.episode] = reason
            if action != "finished":
                capture.seen[tracker.episode] = tracker.version
            capture.entries[tracker.episode] = _entry(tracker, action, offset + 1)
        if not capture.waiting and len(capture.markers) == len(capture.owned):
            capture.resolved.set()


def _entry(tracker: EpisodeTracker, action: str, cut: int) -> ManifestEntry:
    return ManifestEntry(
        tracker.episode,
        tracker.attempt,
        action,  # type: ignore[arg-type]
        tracker.partition,
        cut,
        tracker.last_stage,
        tracker.staging_keys_at_cut(),
        tracker.size_bytes,
    )
