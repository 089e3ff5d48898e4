"""A checkpoint's continued projections, prepared ahead of a restore (docs/design.md §10 "A
restore"): once a checkpoint this service captured whole commits, the projection line of each
episode it continues is composed in the background, off the checkpoint's path, from the records
its tracker's positions name (``compose_stream``), while the tracker is still its state at the
cut. A restore of that checkpoint takes them (each given the restore's attempt,
``ProjectionLine.as_attempt``) instead of composing them after its commit; an episode not
prepared by then (the prepare still under way, a tracker that had moved on, lines over the
budget) is composed or replayed as before.

One prepare per run, started ``DELAY_S`` after the commit: a checkpoint of the run that begins
stops it (it would hold the event loop from the checkpoint), a newer committed one replaces it
and keeps the lines of every episode unchanged since (``RestorePreparer``), the restore that
takes it ends it.

The budget counts what the lines hold on the heap (``ProjectionLine.held_bytes``): a large state
is a view of a mapped file, its blob file's on the embedded log, or one the prepare writes for
its line when the log gave a copy (``_spill``; docs/design.md §11, "A prepared large state is
kept mapped, not on the heap").
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Literal

from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import LINE_OVERHEAD, SPLICE_BYTES, ProjectionLine, composable, mapped
from rolloutlog.log import Log, mapped_copies
from rolloutlog.projections._capture import CheckpointCapture
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._replay import Composable, compose_stream

__all__ = ["PreparedLines", "RestorePreparer"]

logger = logging.getLogger("rolloutlog.projections")

#: Of the disk under the temporary directory, what a prepare leaves free: it keeps a large
#: state in a file only while that much would still be free after it.
SPILL_RESERVE_BYTES = 1 << 30
#: How long after its checkpoint's commit a prepare starts: checkpoints taken back to back (a
#: trainer that checkpoints every step) pay nothing for it, the next one cancels it before it
#: starts. (Started at once, it held the event loop and the GIL from S1's next checkpoint,
#: 0.4 s later: that checkpoint took 43 ms instead of 22.)
DELAY_S = 1.0
#: How many episodes a prepare handles before it lets the event loop run (~1-2 ms of S1's):
#: small, so that what the service is asked meanwhile waits little for it.
_SLICE = 32

State = Literal["preparing", "ready", "skipped", "failed", "cancelled"]


class PreparedLines:
    """One checkpoint's prepared lines, by episode, each of the attempt its entry names, with
    the tracker version it was composed at (``versions``)."""

    def __init__(self, checkpoint_id: int) -> None:
        self.checkpoint_id = checkpoint_id
        self.lines: dict[str, ProjectionLine] = {}
        self.versions: dict[str, int] = {}
        self.size_bytes = 0
        #: Of them, how many the previous prepare had composed already (carried over).
        self.carried = 0
        self.state: State = "preparing"
        self.task: asyncio.Task[None] | None = None

    def add(self, line: ProjectionLine, version: int) -> None:
        self.lines[line.episode] = line
        self.versions[line.episode] = version
        self.size_bytes += line.held_bytes

    def line_at(self, episode: str, version: int) -> ProjectionLine | None:
        """The episode's line if it was composed from its tracker at ``version``."""
        return self.lines.get(episode) if self.versions.get(episode) == version else None

    def skip(self) -> None:
        """Over the budget: nothing is kept."""
        self.lines.clear()
        self.versions.clear()
        self.size_bytes = 0
        self.state = "skipped"


class RestorePreparer:
    """The runs' prepares (``start`` when a checkpoint commits, ``take`` when it is restored),
    their lines within ``budget_bytes`` each.

    A line depends only on its tracker's state (and the attempt it names), not on the
    checkpoint: an episode whose tracker has not changed since the previous prepare composed
    its line (the same version: what a pin relies on) keeps that line. A live run's prepare
    composes only what changed since the one before, even one a checkpoint cancelled midway."""

    def __init__(
        self,
        log: Log,
        budget_bytes: int,
        superseded: Callable[[str], None] = lambda run: None,
        *,
        spill_dir: str | None = None,
    ) -> None:
        self.log = log
        self.budget_bytes = budget_bytes
        #: Where the large states read from a log that copies them are kept (``_spill``):
        #: the temporary directory by default.
        self.spill_dir = spill_dir
        #: Called as a run's prepare begins: the run's older restores' cached lines go (a
        #: restore's participants fetch them at once; later, they are built again).
        self._superseded = superseded
        self._runs: dict[str, PreparedLines] = {}

    def status(self) -> dict[str, PreparedLines]:
        """Each run's newest prepare (as the metrics show it)."""
        return dict(self._runs)

    def pause(self, run: str) -> None:
        """A checkpoint of ``run`` begins: its prepare stops here (it would hold the event loop
        from the checkpoint); what it composed is kept for the next one."""
        prepared = self._runs.get(run)
        if prepared is not None and prepared.task is not None and not prepared.task.done():
            prepared.task.cancel()
            prepared.state = "cancelled"

    def forget(self, run: str) -> None:
        """The run is gone (or its lines were taken): nothing of its prepares is kept."""
        self.pause(run)
        self._runs.pop(run, None)

    async def stop(self) -> None:
        """The service stops: every prepare ends (nothing is kept)."""
        tasks = [p.task for p in self._runs.values() if p.task is not None]
        self._runs.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def start(self, projector: Projector, capture: CheckpointCapture) -> None:
        """Prepare the lines of a checkpoint this service captured whole and just committed."""
        run = projector.run
        self.pause(run)
        base = self._runs.get(run)
        prepared = PreparedLines(capture.checkpoint_id)
        whole = capture.compose()
        seen = capture.whole_seen if capture.whole_seen is not None else capture.seen
        self._runs[run] = prepared
        prepared.task = asyncio.create_task(self._fill(projector, prepared, base, whole, seen))

    def take(self, run: str, checkpoint_id: int) -> dict[str, ProjectionLine]:
        """The lines prepared for ``checkpoint_id`` so far, handed to its restore (the prepare
        ends: the restore's commit moves the trackers on, and composes the rest itself)."""
        prepared = self._runs.get(run)
        if prepared is None or prepared.checkpoint_id != checkpoint_id:
            return {}
        self.forget(run)
        return prepared.lines

    async def _fill(
        self,
        projector: Projector,
        prepared: PreparedLines,
        base: PreparedLines | None,
        whole: Mapping[str, ManifestEntry],
        seen: Mapping[str, int],
    ) -> None:
        try:
            await asyncio.sleep(DELAY_S)
            wanted, estimate = [], 0
            trackers = projector.trackers
            for index, entry in enumerate(list(whole.values()), 1):
                if index % (_SLICE * 8) == 0:
                    await asyncio.sleep(0)
                if entry.action != "continue":
                    continue
                episode = entry.episode
                tracker = trackers.get(episode)
                if tracker is None or not tracker.at_cut_of(entry, seen):
                    continue
                # Worked out now, the verdict a restore's plan reads of it is kept until the
                # tracker changes.
                tracker.verdict()
                line = None if base is None else base.line_at(episode, tracker.version)
                if line is not None:
                    prepared.add(line, tracker.version)
                    prepared.carried += 1
                elif composable(tracker):
                    wanted.append(Composable.of(entry, tracker))
                    estimate += tracker.held_payload_bytes() + LINE_OVERHEAD
            base = None  # the lines that changed go with it
            if prepared.size_bytes + estimate > self.budget_bytes:
                prepared.skip()
                return
            self._superseded(projector.run)

            # A slice at a time, its large states each line's file (``_spill``).
            # (An episode that moved on meanwhile is not prepared: ``failed`` is not needed.)
            lines: list[ProjectionLine] = []
            try:
                composed = compose_stream(self.log, projector.run, wanted, trackers, [])
                async for projection in composed:
                    lines.append(ProjectionLine.of(projection))
                    if len(lines) == _SLICE:
                        kept, lines = await self._keep(prepared, lines, seen), []
                        if not kept:
                            return
                        await asyncio.sleep(0)
            except Exception:
                await self._keep(prepared, lines, seen)  # what was composed stands
                raise
            if await self._keep(prepared, lines, seen):
                prepared.state = "ready"
        except asyncio.CancelledError:
            raise
        except Exception:
            # What it prepared stands (each line was composed at the cut); the rest is composed
            # by the restore, as without a prepare.
            logger.exception(
                "run %s: preparing checkpoint %s failed", projector.run, prepared.checkpoint_id
            )
            prepared.state = "failed"

    async def _keep(
        self, prepared: PreparedLines, lines: list[ProjectionLine], seen: Mapping[str, int]
    ) -> bool:
        """Add a slice's lines (their large states spilled); False when that went over the
        budget and nothing is kept."""
        for line in await self._spill(lines):
            prepared.add(line, seen[line.episode])
        if prepared.size_bytes > self.budget_bytes:
            prepared.skip()
            return False
        return True

    async def _spill(self, lines: list[ProjectionLine]) -> list[ProjectionLine]:
        """``lines`` with each large state still on the heap (a log that copies its records,
        Kafka's) moved to a file of its line's own and carried as a view of its mapping
        (``mapped_copies``), as the embedded log's are read in place: the page cache holds
        them, not the heap, the restore's stream writes them as they are, and the file goes
        with the line (a line carried over to later prepares keeps no other line's file). A
        slice's states stay on the heap when the disk is short of room or refuses a write (the
        budget decides)."""
        found: dict[int, list[int]] = {}  # a line's index: where its large states are
        for index, line in enumerate(lines):
            ats = [at for at, piece in enumerate(line.pieces) if _on_heap(at, piece)]
            if ats:
                found[index] = ats
        if not found:
            return lines
        large = [[lines[index].pieces[at] for at in ats] for index, ats in found.items()]
        try:
            views = await asyncio.to_thread(self._write_files, large)
        except OSError as e:
            logger.warning("prepared lines keep their large states in memory: %s", e)
            return lines
        out = list(lines)
        for (index, ats), mine in zip(found.items(), views, strict=True):
            pieces = list(lines[index].pieces)
            for at, view in zip(ats, mine, strict=True):
                pieces[at] = view
            out[index] = lines[index]._replace(pieces=tuple(pieces))
        return out

    def _write_files(self, large: list[list[bytes | memoryview]]) -> list[list[memoryview]]:
        """Each line's large states in a file of its own (``mapped_copies``), in a worker
        thread: refused when the disk would keep less than ``SPILL_RESERVE_BYTES`` free."""
        size = sum(len(piece) for pieces in large for piece in pieces)
        free = shutil.disk_usage(self.spill_dir or tempfile.gettempdir()).free
        if free - size < SPILL_RESERVE_BYTES:
            raise OSError(errno.ENOSPC, f"{free} bytes free, {size} to keep")
        return [mapped_copies(pieces, self.spill_dir) for pieces in large]


def _on_heap(at: int, piece: bytes | memoryview) -> bool:
    """A line's piece that is a large state on the heap (not the head, not mapped already)."""
    return at > 0 and len(piece) >= SPLICE_BYTES and not mapped(piece)
