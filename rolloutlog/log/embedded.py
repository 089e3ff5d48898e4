"""The embedded log backend: one SQLite file per run, in WAL mode, under a data directory.

A run file's requests queue up and one thread of a small shared pool drains them in commit groups:
every append queued while the previous transaction was committing shares the next one, so many
concurrent appenders cost one fsync. An append's future resolves only after its group committed
(``synchronous=FULL``: durable across a SIGKILL of the process and across power loss). Readers use
their own connections; WAL lets them read while the writer writes.

Records are stored in *segments*, like Kafka's record batches (``_segments``): a group of
thousands of small events costs a few row inserts instead of thousands. A committed group's
records also stay in memory as each partition's *tail* (its newest records, ``_TAIL_BYTES`` a
run): a follower at the tip (the projector) takes them from there rather than reading back and
decoding what was just written (~13% of the log's CPU per event, ``api_append_follow.py``).

Resources stay bounded however many runs there are: ``_WRITER_THREADS`` writer threads in all;
a run file's write connection and its one idle reader open on demand, and the least recently
written run files close them beyond a budget taken from the descriptor limit; at most
``_READERS_PER_RUN`` readers per run at once, each borrowed for one step (SQLite keeps the
descriptor of a closed connection open while others hold the file, so a file keeps as many as
it ever had open at once).

A commit group that fails (a full disk) leaves nothing behind: its transaction rolls back, its
blob bytes are cut off and its offsets are handed out again; its appends are refused with
``BackendUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import resource
import shutil
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from rolloutlog.errors import (
    BackendUnavailable,
    ConfigurationError,
    InvalidRequest,
    LogError,
    UnknownRun,
)
from rolloutlog.log._blobs import BLOB_THRESHOLD, BlobStore
from rolloutlog.log._interface import (
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_PARTITIONS,
    Log,
    Position,
    Record,
    check_partitions,
    check_run_name,
)
from rolloutlog.log._lock import DataDirLock
from rolloutlog.log._record import fitted
from rolloutlog.log._segments import (
    OFFSET_MASK,
    connect,
    fetch_page,
    open_range,
    read_ranges,
    read_run_file,
    row_id,
    segment_row,
    split_segments,
)

__all__ = ["EmbeddedLog", "from_url"]

logger = logging.getLogger(__name__)

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


def _open_files_budget() -> int:
    """How many run files may keep connections open (up to ~8 descriptors each, see the module
    docstring): a thirty-second of the process's descriptor limit, within 4..32."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_OPEN_FILES
    return max(4, min(_MAX_OPEN_FILES, soft // 32))


@dataclass(slots=True)
class _Append:
    records: Sequence[Record]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Position]]
    size: int


@dataclass(slots=True)
class _Call:
    function: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class _Writers:
    """The writer threads every run file shares, and the run files' open write connections.

    A run file with queued requests is *scheduled*: one pool thread drains its queue in commit
    groups, so threads do not grow with runs. Write connections open when a run writes and the
    least recently used ones close once more than ``budget`` are open, so descriptors do not
    grow with runs either (an idle run file holds none)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.pool = ThreadPoolExecutor(_WRITER_THREADS, thread_name_prefix="rolloutlog-writer")
        self.open: OrderedDict[_RunFile, None] = OrderedDict()
        self.lock = threading.Lock()

    def schedule(self, function: Callable[[], None]) -> bool:
        """Run ``function`` on a pool thread; False once the pool is shut down."""
        try:
            self.pool.submit(function)
        except RuntimeError:
            return False
        return True

    def opened(self, run_file: _RunFile) -> None:
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

    def forget(self, run_file: _RunFile) -> None:
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


class _RunFile:
    """One run's SQLite file, its request queue and its partition offsets.

    The offsets live in memory: this process is the file's only writer (the data directory is
    locked), so they stay true while the write connection is closed."""

    def __init__(
        self,
        path: Path,
        partitions: int,
        synchronous: str,
        writers: _Writers,
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
        self.requests: queue.SimpleQueue[_Append | _Call] = queue.SimpleQueue()
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

    def submit(self, request: _Append | _Call) -> None:
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

    def _handle(self, item: _Append | _Call) -> None:
        if self.deleted:
            failure = UnknownRun(f"run file {self.path.name} was deleted", path=str(self.path))
            item.loop.call_soon_threadsafe(_fail, item.future, failure)
            return
        if isinstance(item, _Call):
            self._run_call(item)
            return
        group = [item]
        size = item.size
        pending_call: _Call | None = None
        while size < _GROUP_BYTES:
            try:
                more = self.requests.get_nowait()
            except queue.Empty:
                break
            if isinstance(more, _Call):
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
    async def reader(self) -> AsyncIterator[_Reader]:
        """A read connection for one step (a page, a replay): the idle one, or a new one."""
        async with self.reader_slots:
            with self.readers_lock:
                conn, self.idle_reader = self.idle_reader, None
            if conn is None:
                conn = await asyncio.to_thread(connect, self.path, self.synchronous)
            reader = _Reader(conn)
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

    def _commit_group(self, group: list[_Append]) -> None:
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
                failure = _translate(e, self.path)
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

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.function(self._connection())
        except sqlite3.Error as e:
            call.loop.call_soon_threadsafe(_fail, call.future, _translate(e, self.path))
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


def _translate(error: sqlite3.Error | OSError, path: Path) -> Exception:
    if isinstance(error, sqlite3.OperationalError | OSError):
        return BackendUnavailable(f"embedded log {path}: {error}", path=str(path))
    return LogError(f"embedded log {path}: {error}", path=str(path))


class EmbeddedLog(Log):
    """The SQLite-backed log; ``data_dir/log/<run>.sqlite3`` per run.

    ``start`` takes an exclusive lock on ``data_dir/lock`` (``DataDirLocked`` if another process
    holds it): two writers on one run file would hand out the same offsets. ``read_only`` (URL
    ``?read_only=1``) takes no lock and refuses every write: a reader beside a running service
    (WAL lets other processes read while it writes), such as the benchmarks' read floor."""

    def __init__(
        self,
        data_dir: Path,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        synchronous: str = "FULL",
        read_only: bool = False,
    ) -> None:
        if synchronous.upper() not in {"FULL", "NORMAL", "EXTRA"}:
            raise ConfigurationError(
                f"synchronous must be FULL, NORMAL or EXTRA, not {synchronous!r}"
            )
        self.data_dir = Path(data_dir)
        self.url = f"embedded://{self.data_dir}"
        self.max_record_bytes = max_record_bytes
        self.synchronous = synchronous.upper()
        self._runs: dict[str, _RunFile] = {}
        self._lock = asyncio.Lock()
        self._writers: _Writers | None = None
        self._data_dir_lock: DataDirLock | None = None
        self.read_only = read_only

    def _check_writable(self) -> None:
        if self.read_only:
            raise InvalidRequest(f"the embedded log {self.url} is open read-only")

    @property
    def _log_dir(self) -> Path:
        return self.data_dir / "log"

    def _path(self, run: str) -> Path:
        return self._log_dir / f"{run}.sqlite3"

    async def start(self) -> None:
        if self._writers is not None:
            return
        if self.read_only:
            self._writers = _Writers(_open_files_budget())
            return
        self._data_dir_lock = await asyncio.to_thread(DataDirLock.acquire, self.data_dir)
        try:
            await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        except OSError as e:
            self._data_dir_lock.release()
            self._data_dir_lock = None
            raise _translate(e, self._log_dir) from e
        self._writers = _Writers(_open_files_budget())

    async def close(self) -> None:
        writers, self._writers = self._writers, None
        runs, self._runs = list(self._runs.values()), {}
        if writers is not None:
            await asyncio.to_thread(writers.shutdown)  # pending appends finish first
        for run_file in runs:
            await asyncio.to_thread(run_file.release_files, block=True)
        lock, self._data_dir_lock = self._data_dir_lock, None
        if lock is not None:
            lock.release()

    async def ensure_run(self, run: str, partitions: int = DEFAULT_PARTITIONS) -> int:
        self._check_writable()
        check_run_name(run)
        async with self._lock:
            if run in self._runs:
                return self._runs[run].partitions
            if not await asyncio.to_thread(self._path(run).exists):
                check_partitions(partitions)  # new runs only: older, wider ones still open
            run_file = await asyncio.to_thread(self._open_run, run, partitions)
            self._runs[run] = run_file
            return run_file.partitions

    async def partitions(self, run: str) -> int:
        return (await self._run(run)).partitions

    async def _run(self, run: str) -> _RunFile:
        run_file = self._runs.get(run)
        if run_file is not None:
            return run_file
        check_run_name(run)
        async with self._lock:
            if run not in self._runs:
                opened = await asyncio.to_thread(self._open_run, run, None)
                self._runs[run] = opened
            return self._runs[run]

    def _open_run(self, run: str, partitions: int | None) -> _RunFile:
        writers = self._writers
        if writers is None:
            raise LogError("the embedded log is not started")
        path = self._path(run)
        if partitions is None and not path.exists():
            raise UnknownRun(f"run {run!r} has no log", run=run)
        try:
            count, start_offsets, next_offsets = read_run_file(path, partitions, self.synchronous)
            return _RunFile(
                path,
                count,
                self.synchronous,
                writers,
                start_offsets=start_offsets,
                next_offsets=next_offsets,
            )
        except (sqlite3.Error, OSError) as e:
            raise _translate(e, path) from e

    async def delete_run(self, run: str) -> bool:
        """Delete the run's file and blob files; appends queued before fail with ``UnknownRun``
        and its followers end with it. False when the run had no log."""
        self._check_writable()
        check_run_name(run)
        async with self._lock:
            found = self._runs.pop(run, None)
            try:
                run_file: _RunFile = (
                    found
                    if found is not None
                    else await asyncio.to_thread(self._open_run, run, None)
                )
            except UnknownRun:
                return False

            def mark_deleted(conn: sqlite3.Connection) -> None:
                run_file.deleted = True  # on the writer: every request queued later fails

            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            run_file.submit(_Call(mark_deleted, loop, future))
            await future
            run_file.wake_followers()
            if self._writers is not None:
                self._writers.forget(run_file)
            await asyncio.to_thread(run_file.release_files, block=True)
            await asyncio.to_thread(_delete_files, run_file.path)
        return True

    async def append_records(self, run: str, records: Sequence[Record]) -> list[Position]:
        self._check_writable()
        run_file = await self._run(run)
        if not records:
            return []
        partitions = [record.partition for record in records]
        if min(partitions) < 0 or max(partitions) >= run_file.partitions:
            bad = next(p for p in partitions if not 0 <= p < run_file.partitions)
            raise InvalidRequest(f"partition {bad} out of range", run=run)
        self.check_records(records)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Position]] = loop.create_future()
        size = sum([len(record.value) for record in records])
        run_file.submit(_Append(records, loop, future, size))
        return await future

    async def _call(self, run: str, function: Callable[[sqlite3.Connection], Any]) -> Any:
        run_file = await self._run(run)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        run_file.submit(_Call(function, loop, future))
        return await future

    async def read_pages(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Like ``read_records``, a page (list) at a time: cheaper for bulk replays."""
        run_file = await self._run(run)
        if not 0 <= partition < run_file.partitions:
            raise InvalidRequest(f"partition {partition} out of range", run=run)
        start = max(start, run_file.start_offsets[partition], 0)
        if end <= start:
            return
        try:
            async with run_file.reader() as reader:
                cursor = await reader.run(open_range, reader.conn, partition, start, end)
                try:
                    while True:
                        page = await reader.run(fetch_page, cursor, start, end, run_file.blobs)
                        if not page:
                            return
                        yield page
                finally:
                    await reader.run(cursor.close)  # ends the read transaction
        except (sqlite3.Error, OSError) as e:
            raise _translate(e, run_file.path) from e

    async def follow(
        self, run: str, partition: int, start: int, *, poll_s: float = 0.05
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Pages from ``start`` on; woken by each commit (``poll_s`` is unused here)."""
        run_file = await self._run(run)
        if not 0 <= partition < run_file.partitions:
            raise InvalidRequest(f"partition {partition} out of range", run=run)
        starts = [run_file.next_offsets[p] for p in range(run_file.partitions)]
        starts[partition] = start
        async for _, page in self._follow(run_file, starts, {partition}):
            yield page

    async def follow_run(
        self,
        run: str,
        starts: Sequence[int],
        *,
        partitions: Collection[int] | None = None,
        poll_s: float = 0.05,
    ) -> AsyncIterator[tuple[int, list[tuple[int, bytes]]]]:
        """Every partition's (or ``partitions``') pages from ``starts`` on: one follower, which
        borrows a reader of the run file for each step (none while it waits for a commit)."""
        run_file = await self._run(run)
        if len(starts) != run_file.partitions:
            raise InvalidRequest(
                f"starts has {len(starts)} offsets; run {run!r} has {run_file.partitions} "
                "partitions",
                run=run,
            )
        followed = set(range(run_file.partitions))
        async for item in self._follow(
            run_file, starts, followed if partitions is None else followed & set(partitions)
        ):
            yield item

    async def _follow(
        self, run_file: _RunFile, starts: Sequence[int], partitions: set[int]
    ) -> AsyncIterator[tuple[int, list[tuple[int, bytes]]]]:
        loop = asyncio.get_running_loop()
        next_offsets = [
            max(s, first) for s, first in zip(starts, run_file.start_offsets, strict=True)
        ]
        try:
            while True:
                woken = asyncio.Event()
                with run_file.waiters_lock:
                    run_file.waiters.add((loop, woken))
                if run_file.deleted:
                    raise UnknownRun(f"run file {run_file.path.name} was deleted")
                ends = run_file.next_offsets
                ranges = [
                    (p, next_offsets[p], ends[p]) for p in partitions if ends[p] > next_offsets[p]
                ]
                if not ranges:
                    await woken.wait()
                    continue
                pages: list[tuple[int, list[tuple[int, bytes]]]] = []
                unread: list[tuple[int, int, int]] = []
                for partition, start, end in ranges:
                    page = run_file.from_tail(partition, start, end)
                    if page is None:
                        unread.append((partition, start, end))
                    elif page:
                        pages.append((partition, page))
                if not pages and not unread:
                    # Offsets handed out, their group not committed yet: its commit wakes us.
                    await woken.wait()
                    continue
                with run_file.waiters_lock:
                    run_file.waiters.discard((loop, woken))
                if unread:
                    async with run_file.reader() as reader:
                        pages += await reader.run(read_ranges, reader.conn, unread, run_file.blobs)
                for partition, page in pages:
                    next_offsets[partition] = page[-1][0] + 1
                    yield partition, page
        except (sqlite3.Error, OSError) as e:
            raise _translate(e, run_file.path) from e

    async def trim(self, run: str, partition: int, before: int) -> bool:
        self._check_writable()
        run_file = await self._run(run)

        def delete(conn: sqlite3.Connection) -> None:
            start = run_file.start_offsets[partition]
            if before <= start:
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Whole segments below ``before`` go; a segment straddling it stays, and reads
                # skip its trimmed head (they start at the partition's start offset).
                conn.execute(
                    "DELETE FROM segments WHERE id >= ? AND id < ? AND (id & ?) + count <= ?",
                    (row_id(partition, 0), row_id(partition, before), OFFSET_MASK, before),
                )
                conn.execute(
                    "INSERT INTO partitions (partition, start_offset) VALUES (?, ?) "
                    "ON CONFLICT (partition) DO UPDATE SET start_offset = excluded.start_offset",
                    (partition, before),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            run_file.start_offsets[partition] = before
            run_file.next_offsets[partition] = max(run_file.next_offsets[partition], before)
            run_file.drop_tail(partition)
            # Blob files below the lowest one a remaining segment refers to hold nothing live.
            (lowest,) = conn.execute("SELECT min(blob_file) FROM segments").fetchone()
            run_file.blobs.delete_below(run_file.blobs.current if lowest is None else lowest)

        await self._call(run, delete)
        return True

    async def end_offsets(self, run: str) -> list[int]:
        return list((await self._run(run)).next_offsets)


def _delete_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.rmtree(path.with_suffix(".blobs"), ignore_errors=True)


class _Reader:
    """A read connection whose blocking calls run in a worker thread. ``finish`` waits for a call
    still running there (say, when the reading task was cancelled) before the connection is
    handed on or closed."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._running: asyncio.Future[Any] | None = None

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        self._running = asyncio.ensure_future(asyncio.to_thread(function, *args))
        result = await asyncio.shield(self._running)
        self._running = None
        return result

    async def finish(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            with contextlib.suppress(BaseException):
                await running


def from_url(url: str, **options: Any) -> EmbeddedLog:
    """``embedded:///abs/path`` (or ``embedded://rel/path``), with optional ``?synchronous=``,
    ``?max_record_bytes=`` and ``?read_only=1``."""
    parts = urlsplit(url)
    path = unquote(parts.netloc + parts.path)
    if not path:
        raise ConfigurationError(f"embedded log URL needs a path: {url!r}")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    if "synchronous" in query:
        options.setdefault("synchronous", query["synchronous"])
    if "max_record_bytes" in query:
        options.setdefault("max_record_bytes", int(query["max_record_bytes"]))
    if "read_only" in query:
        options.setdefault("read_only", query["read_only"].lower() in {"1", "true", "yes"})
    return EmbeddedLog(Path(path), **options)
