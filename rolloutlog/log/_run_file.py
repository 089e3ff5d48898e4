"""The embedded log's run files: one SQLite file per run, its writer and its tails.

A run file (``RunFile``) queues its requests; one thread of the log's shared pool (``Writers``)
drains them in commit groups (``_commit_group``: offsets handed out, large records to blob files,
one segment row per partition, one transaction) and keeps each partition's newest records in
memory for the followers at the tip (``_keep_tail``). Readers borrow pooled read connections
(``reader``, ``Reader``). ``embedded.py``'s ``EmbeddedLog`` holds the run files and serves the
``Log`` interface on them; its module docstring tells the whole design.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import resource
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutlog.errors import (
    BackendUnavailable,
    LogError,
    UnknownRun,
)
from rolloutlog.log._blobs import BLOB_THRESHOLD, BlobStore
from rolloutlog.log._interface import (
    Position,
    Record,
)
from rolloutlog.log._record import fitted
from rolloutlog.log._segments import (
    connect,
    segment_row,
    split_segments,
)

__all__ = [
    "Append",
    "RunCall",
    "Reader",
    "RunFile",
    "Writers",
    "open_files_budget",
    "translate",
]

#: The embedded log's logger (its records say ``rolloutlog.log.embedded``, as they did).
logger = logging.getLogger("rolloutlog.log.embedded")

#: Writer threads shared by every run file of a log.
_WRITER_THREADS = 4
#: A drain hands its thread back after this many commit groups (busy runs share the pool).
_GROUPS_PER_TURN = 8
#: Run files with open connections, at most (fewer under a low descriptor limit).
_MAX_OPEN_FILES = 32
#: Read connections of one run file at once, at most.
_READERS_PER_RUN = 4
#: A commit group stops growing at this many bytes (bounds the writer's memory and latency).
_GROUP_BYTES = 64 * 1024 * 1024
#: The checkpointer runs after this many bytes were committed to the WAL.
_CHECKPOINT_BYTES = 32 * 1024 * 1024
#: Bytes of a run's latest committed records kept in memory for its followers (split evenly
#: between its partitions).
_TAIL_BYTES = 4 * 1024 * 1024


def open_files_budget() -> int:
    """How many run files may keep connections open (up to ~8 descriptors each, see the module
    docstring): a thirty-second of the process's descriptor limit, within 4..32."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_OPEN_FILES
    return max(4, min(_MAX_OPEN_FILES, soft // 32))


@dataclass(slots=True)
class Append:
    records: Sequence[Record]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Position]]
    size: int


@dataclass(slots=True)
class RunCall:
    function: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class Writers:
    """The writer threads every run file shares, and the run files' open write connections.

    A run file with queued requests is *scheduled*: one pool thread drains its queue in commit
    groups, so threads do not grow with runs. Write connections open when a run writes and the
    least recently used ones close once more than ``budget`` are open, so descriptors do not
    grow with runs either (an idle run file holds none)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.pool = ThreadPoolExecutor(_WRITER_THREADS, thread_name_prefix="rolloutlog-writer")
        self.open: OrderedDict[RunFile, None] = OrderedDict()
        self.lock = threading.Lock()

    def schedule(self, function: Callable[[], None]) -> bool:
        """Run ``function`` on a pool thread; False once the pool is shut down."""
        try:
            self.pool.submit(function)
        except RuntimeError:
            return False
        return True

    def opened(self, run_file: RunFile) -> None:
        """``run_file`` (whose writer is running) uses its connection: close idle ones over budget."""
        with self.lock:
            self.open[run_file] = None
            self.open.move_to_end(run_file)
            over = len(self.open) - self.budget
            for other in list(self.open):
                if over <= 0:
                    break
                if other is not run_file and other.release_files(block=False):
                    del self.open[other]
                    over -= 1

    def forget(self, run_file: RunFile) -> None:
        with self.lock:
            self.open.pop(run_file, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def _checkpoint(path: Path, synchronous: str) -> None:
    try:
        conn = connect(path, synchronous)
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()
    except sqlite3.Error:
        # A failed checkpoint loses nothing (the WAL keeps every commit); a later one retries.
        logger.warning("WAL checkpoint of %s failed", path, exc_info=True)


class RunFile:
    """One run's SQLite file, its request queue and its partition offsets.

    The offsets live in memory: this process is the file's only writer (the data directory is
    locked), so they stay true while the write connection is closed."""

    def __init__(
        self,
        path: Path,
        partitions: int,
        synchronous: str,
        writers: Writers,
        *,
        start_offsets: list[int],
        next_offsets: list[int],
    ) -> None:
        self.path = path
        self.partitions = partitions
        self.synchronous = synchronous
        self.writers = writers
        self.start_offsets = start_offsets
        self.next_offsets = next_offsets
        self.blobs = BlobStore(path.with_suffix(".blobs"), sync=synchronous in ("FULL", "EXTRA"))
        self.requests: queue.SimpleQueue[Append | RunCall] = queue.SimpleQueue()
        self.conn: sqlite3.Connection | None = None
        #: Held by whoever uses ``conn`` (the draining thread, or one closing it).
        self.busy = threading.Lock()
        self.scheduled = False
        self.schedule_lock = threading.Lock()
        self.deleted = False
        self.wal_bytes = 0
        #: One idle read connection kept for the next reader; ``readers_lock`` guards it.
        self.idle_reader: sqlite3.Connection | None = None
        self.readers_lock = threading.Lock()
        self.reader_slots = asyncio.Semaphore(_READERS_PER_RUN)
        #: Followers waiting for the next commit: (their loop, their event).
        self.waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.waiters_lock = threading.Lock()
        #: Per partition, its latest committed records, (offset, value) with consecutive
        #: offsets: a follower at the tip takes its next records from here instead of reading
        #: back (and decoding) the segments just written. Only the writer thread changes a list
        #: (appending to it, or replacing it); a follower copies a slice.
        self.tail: list[list[tuple[int, bytes]]] = [[] for _ in range(partitions)]
        self.tail_bytes = [0] * partitions

    def submit(self, request: Append | RunCall) -> None:
        self.requests.put(request)
        with self.schedule_lock:
            if self.scheduled:
                return
            self.scheduled = True
        if not self.writers.schedule(self.drain):
            self.drain()  # the log is closing: finish here rather than strand the request

    def drain(self) -> None:
        """Commit queued requests in groups (on a pool thread) until the queue is empty, or
        hand the thread back after a few groups so that busy runs share the pool."""
        with self.busy:
            for _ in range(_GROUPS_PER_TURN):
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    with self.schedule_lock:
                        if self.requests.empty():
                            self.scheduled = False
                            return
                    continue
                try:
                    self._handle(item)
                except Exception:  # never lose the run's writer over one request
                    logger.exception("embedded log %s: a write request failed", self.path)
        if not self.writers.schedule(self.drain):
            self.drain()

    def _handle(self, item: Append | RunCall) -> None:
        if self.deleted:
            failure = UnknownRun(f"run file {self.path.name} was deleted", path=str(self.path))
            item.loop.call_soon_threadsafe(_fail, item.future, failure)
            return
        if isinstance(item, RunCall):
            self._run_call(item)
            return
        group = [item]
        size = item.size
        pending_call: RunCall | None = None
        while size < _GROUP_BYTES:
            try:
                more = self.requests.get_nowait()
            except queue.Empty:
                break
            if isinstance(more, RunCall):
                pending_call = more
                break
            group.append(more)
            size += more.size
        self._commit_group(group)
        if pending_call is not None:
            self._handle(pending_call)

    def _connection(self) -> sqlite3.Connection:
        if self.conn is None:
            self.conn = connect(self.path, self.synchronous)
        self.writers.opened(self)
        return self.conn

    def release_files(self, *, block: bool) -> bool:
        """Close the write connection, the idle reader and the blob descriptor unless a writer
        uses them (``block``: wait for it); True when they are closed."""
        if not self.busy.acquire(blocking=block):
            return False
        try:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.close()
            self.blobs.close()
            with self.readers_lock:
                idle, self.idle_reader = self.idle_reader, None
            if idle is not None:
                idle.close()
        finally:
            self.busy.release()
        return True

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[Reader]:
        """A read connection for one step (a page, a replay): the idle one, or a new one."""
        async with self.reader_slots:
            with self.readers_lock:
                conn, self.idle_reader = self.idle_reader, None
            if conn is None:
                conn = await asyncio.to_thread(connect, self.path, self.synchronous)
            reader = Reader(conn)
            try:
                yield reader
            finally:
                await reader.finish()
                with self.readers_lock:
                    keep = self.idle_reader is None and not self.deleted
                    if keep:
                        self.idle_reader = conn
                if not keep:
                    conn.close()

    # -- on the draining thread ----------------------------------------------------------------

    def _commit_group(self, group: list[Append]) -> None:
        saved = list(self.next_offsets)
        next_offsets = self.next_offsets
        blobs = self.blobs
        mark = blobs.mark()
        conn: sqlite3.Connection | None = None
        try:
            # Per partition: the first offset the group gives it and the values, in order (its
            # offsets are consecutive). One short loop per record: the writer holds the GIL
            # the service's event loop needs while it runs.
            added: dict[int, tuple[int, list[bytes]]] = {}
            results: list[list[Position]] = []
            for request in group:
                partitions: list[int] = []
                offsets: list[int] = []
                add_partition = partitions.append
                add_offset = offsets.append
                for record in request.records:
                    partition = record.partition
                    offset = next_offsets[partition]
                    next_offsets[partition] = offset + 1
                    add_partition(partition)
                    add_offset(offset)
                    values = added.get(partition)
                    if values is None:
                        added[partition] = (offset, [record.value])
                    else:
                        values[1].append(record.value)
                results.append(list(map(_position, zip(partitions, offsets, strict=True))))
            rows = [
                segment_row(partition, segment, blobs)
                for partition, (first, values) in added.items()
                for segment in split_segments(first, values)
            ]
            conn = self._connection()
            blobs.flush()  # before the segments that refer to it
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO segments (id, count, blob_file, value) VALUES (?, ?, ?, ?)", rows
            )
            conn.execute("COMMIT")
        except Exception as e:  # whatever failed, every appender gets an answer
            # Nothing of the group stays: its offsets are handed out again, its blob bytes cut
            # off, its transaction (if it began) rolled back.
            self.next_offsets[:] = saved
            blobs.rollback(mark)
            if conn is not None and conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(e, sqlite3.Error | OSError):
                failure = translate(e, self.path)
            else:
                logger.exception("embedded log %s: a commit group failed", self.path)
                failure = LogError(f"embedded log {self.path}: {e!r}", path=str(self.path))
            for request in group:
                request.loop.call_soon_threadsafe(_fail, request.future, failure)
            return
        self._keep_tail(added)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for request, positions in zip(group, results, strict=True):
            by_loop.setdefault(request.loop, []).append((request.future, positions))
        for loop, done in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, done)
        self.wal_bytes += sum(len(row[3]) for row in rows)
        if self.wal_bytes >= _CHECKPOINT_BYTES:
            self.wal_bytes = 0
            self.writers.schedule(functools.partial(_checkpoint, self.path, self.synchronous))
        self.wake_followers()

    def _keep_tail(self, added: dict[int, tuple[int, list[bytes]]]) -> None:
        """Add a committed group's records (per partition: its first offset and values) to the
        partitions' tails (before the followers are woken); a tail keeps the newest records
        that fit its share of ``_TAIL_BYTES``, none of them stored in a blob file."""
        limit = _TAIL_BYTES // self.partitions
        for partition, (first, values) in added.items():
            if max(map(len, values)) >= BLOB_THRESHOLD:
                # A record in a blob file is read from there (its tail starts after it): the
                # follower checks the file it will be restored from, and memory stays small.
                self.tail[partition], self.tail_bytes[partition] = [], 0
                continue
            # Copies of their length: the append's bytes may sit in a larger buffer (orjson's
            # holds 4 KB for a 230-byte record), and the tail is counted by length.
            kept = list(map(fitted, values))
            tail, size = self.tail[partition], self.tail_bytes[partition]
            if not tail or tail[-1][0] + 1 != first:
                tail, size = [], 0  # the first records, or offsets jumped (a trim past the end)
            tail.extend(zip(range(first, first + len(kept)), kept, strict=True))
            size += sum(map(len, kept))
            if size > limit:
                # Keep the newest records that fit half of it (maybe none): trimmed once per
                # half a tail of appends, not after every group (each trim copies the list).
                cut = 0
                while size > limit // 2 and cut < len(tail):
                    size -= len(tail[cut][1])
                    cut += 1
                tail = tail[cut:]
            self.tail[partition], self.tail_bytes[partition] = tail, size

    def from_tail(self, partition: int, start: int, end: int) -> list[tuple[int, bytes]] | None:
        """The committed records of ``[start, end)`` held in memory, up to the last committed
        one (None unless the tail holds ``start``, or the records just before the first one
        committed: then the follower reads the file)."""
        tail = self.tail[partition]
        if not tail or start < self.start_offsets[partition]:
            return None
        index = start - tail[0][0]
        if index < 0 or index > len(tail):
            return None
        return tail[index : index + end - start]

    def drop_tail(self, partition: int) -> None:
        self.tail[partition] = []
        self.tail_bytes[partition] = 0

    def wake_followers(self) -> None:
        with self.waiters_lock:
            waiters, self.waiters = self.waiters, set()
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def _run_call(self, call: RunCall) -> None:
        try:
            result = call.function(self._connection())
        except sqlite3.Error as e:
            call.loop.call_soon_threadsafe(_fail, call.future, translate(e, self.path))
        except BaseException as e:  # hand any failure to the caller, keep the writer alive
            call.loop.call_soon_threadsafe(_fail, call.future, e)
        else:
            call.loop.call_soon_threadsafe(_resolve_all, [(call.future, result)])


#: ``Position(partition, offset)`` from a pair without a Python frame (the writer makes one per
#: record).
_position = functools.partial(tuple.__new__, Position)


def _resolve_all(done: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, result in done:
        if not future.done():
            future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def translate(error: sqlite3.Error | OSError, path: Path) -> Exception:
    if isinstance(error, sqlite3.OperationalError | OSError):
        return BackendUnavailable(f"embedded log {path}: {error}", path=str(path))
    return LogError(f"embedded log {path}: {error}", path=str(path))


class Reader:
    """A read connection whose blocking calls run in a worker thread, one at a time. A call
    still running there (its task was cancelled while it waited) ends before the next one
    starts (the cancelled read's ``cursor.close`` would otherwise run beside its fetch: sqlite3
    refused that as recursive use of the cursor, or the process crashed), and ``finish`` waits
    for it before the connection is handed on or closed."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._running: asyncio.Future[Any] | None = None

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        await self.finish()
        self._running = asyncio.ensure_future(asyncio.to_thread(function, *args))
        result = await asyncio.shield(self._running)
        self._running = None
        return result

    async def finish(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            with contextlib.suppress(BaseException):
                await running
