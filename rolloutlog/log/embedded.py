"""The embedded log backend: one SQLite file per run, in WAL mode, under a data directory.

One writer thread per run owns the write connection and commits in groups: every append queued
while the previous transaction was committing shares the next one, so many concurrent appenders
cost one fsync. An append's future resolves only after its group committed (``synchronous=FULL``:
durable across a SIGKILL of the process and across power loss). Readers use their own connections;
WAL lets them read while the writer writes.

Records are stored in *segments*, like Kafka's record batches: the records of one partition that
one commit group appended become one row (split at ``_SEGMENT_BYTES``), whose id is
``partition << 40 | first offset``. The table's own primary key then orders segments by partition and
offset, a range read is one index range scan, and a group of thousands of small events costs a few
row inserts instead of thousands.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import queue
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from rolloutlog.errors import BackendUnavailable, InvalidRequest, LogError, UnknownRun
from rolloutlog.log._blobs import BLOB_THRESHOLD, BlobStore
from rolloutlog.log._interface import (
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_PARTITIONS,
    Log,
    Position,
    Record,
    check_run_name,
)

__all__ = ["EmbeddedLog", "from_url"]

_OFFSET_BITS = 40
_MAX_PARTITIONS = 1 << 16
#: A commit group stops growing at this many bytes (bounds the writer's memory and latency).
_GROUP_BYTES = 64 * 1024 * 1024
#: A segment stops growing at this many bytes (a larger record is a segment of its own).
_SEGMENT_BYTES = 1024 * 1024
#: A read page stops at this many bytes or segments, whichever comes first.
_PAGE_BYTES = 8 * 1024 * 1024
_PAGE_SEGMENTS = 64
#: The checkpointer runs after this many bytes were committed to the WAL.
_CHECKPOINT_BYTES = 32 * 1024 * 1024
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY,  -- partition << 40 | offset of the first record
    count INTEGER NOT NULL,
    blob_file INTEGER,       -- the lowest blob file the segment refers to, if any
    value BLOB NOT NULL      -- count little-endian uint32 lengths, then the records
);
CREATE INDEX IF NOT EXISTS segments_blob_file ON segments (blob_file) WHERE blob_file IS NOT NULL;
CREATE TABLE IF NOT EXISTS partitions (
    partition INTEGER PRIMARY KEY,
    start_offset INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _row_id(partition: int, offset: int) -> int:
    return (partition << _OFFSET_BITS) | offset


#: A length with this bit set says the record is in a blob file; its body is the reference.
_EXTERNAL = 0x80000000


def _encode_segment(values: list[bytes], blobs: BlobStore) -> tuple[bytes, int | None]:
    """A segment's bytes, and the lowest blob file it refers to (large records go there)."""
    lengths = array.array("I")
    bodies: list[bytes] = []
    lowest: int | None = None
    for value in values:
        if len(value) >= BLOB_THRESHOLD:
            if lowest is None:
                lowest = blobs.current
            value = blobs.stage(value)
            lengths.append(_EXTERNAL | len(value))
        else:
            lengths.append(len(value))
        bodies.append(value)
    if not _LITTLE_ENDIAN:
        lengths.byteswap()
    return lengths.tobytes() + b"".join(bodies), lowest


def _decode_segment(
    first: int, count: int, blob: bytes, start: int, end: int, blobs: BlobStore
) -> list[tuple[int, bytes]]:
    """The records of a segment whose offsets fall in ``[start, end)``."""
    lengths = array.array("I")
    lengths.frombytes(blob[: 4 * count])
    if not _LITTLE_ENDIAN:
        lengths.byteswap()
    view = memoryview(blob)
    position = 4 * count
    out: list[tuple[int, bytes]] = []
    for index, length in enumerate(lengths):
        offset = first + index
        size = length & ~_EXTERNAL
        if start <= offset < end:
            body = view[position : position + size]
            out.append((offset, blobs.read(body) if length & _EXTERNAL else bytes(body)))
        position += size
    return out


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    # Small pages: a commit rewrites the last leaf page of every partition it appends to, and
    # big payloads cost little more in 4 KiB overflow pages (the WAL is copied off-thread).
    conn.execute("PRAGMA page_size=4096")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    return conn


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


_STOP = object()


@dataclass
class _RunFile:
    """One run's SQLite file, its writer thread and its partition offsets."""

    path: Path
    partitions: int
    synchronous: str
    next_offsets: list[int] = field(default_factory=list)
    start_offsets: list[int] = field(default_factory=list)
    requests: queue.SimpleQueue[object] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    conn: sqlite3.Connection | None = None
    blobs: BlobStore | None = None
    #: The checkpointer copies the WAL into the database off the writer's path.
    checkpointer: threading.Thread | None = None
    wal_bytes: int = 0
    wal_grew: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    #: Followers waiting for the next commit: (their loop, their event).
    waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=set)
    waiters_lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self) -> None:
        conn = _connect(self.path, self.synchronous)
        self.conn = conn
        self.blobs = BlobStore(
            self.path.with_suffix(".blobs"), sync=self.synchronous in ("FULL", "EXTRA")
        )
        rows = conn.execute("SELECT partition, start_offset FROM partitions").fetchall()
        starts = dict(rows)
        self.start_offsets = [starts.get(p, 0) for p in range(self.partitions)]
        self.next_offsets = []
        for p in range(self.partitions):
            last = conn.execute(
                "SELECT id, count FROM segments WHERE id >= ? AND id < ? ORDER BY id DESC LIMIT 1",
                (_row_id(p, 0), _row_id(p + 1, 0)),
            ).fetchone()
            following = 0 if last is None else (last[0] & _OFFSET_MASK) + last[1]
            self.next_offsets.append(max(following, self.start_offsets[p]))
        # WAL checkpoints copy every committed byte a second time; the checkpointer thread does
        # that beside the writer instead of inside whichever commit crosses the threshold.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        self.stopping = False
        self.thread = threading.Thread(
            target=self._write_loop, name=f"rolloutlog-writer-{self.path.stem}", daemon=True
        )
        self.thread.start()
        self.checkpointer = threading.Thread(
            target=self._checkpoint_loop, name=f"rolloutlog-wal-{self.path.stem}", daemon=True
        )
        self.checkpointer.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.requests.put(_STOP)
            self.thread.join()
            self.thread = None
        if self.checkpointer is not None:
            self.stopping = True
            self.wal_grew.set()
            self.checkpointer.join()
            self.checkpointer = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.blobs is not None:
            self.blobs.close()
            self.blobs = None

    # -- the writer thread ---------------------------------------------------------------------

    def _checkpoint_loop(self) -> None:
        conn = _connect(self.path, self.synchronous)
        try:
            while True:
                self.wal_grew.wait()
                self.wal_grew.clear()
                if self.stopping:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    return
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:
            # A failed checkpoint loses nothing (the WAL keeps every commit); the next one retries.
            return
        finally:
            conn.close()

    def _write_loop(self) -> None:
        while True:
            item = self.requests.get()
            if item is _STOP:
                return
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            assert isinstance(item, _Append)
            group = [item]
            size = item.size
            stop_after = False
            pending_call: _Call | None = None
            while size < _GROUP_BYTES:
                try:
                    more = self.requests.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop_after = True
                    break
                if isinstance(more, _Call):
                    pending_call = more
                    break
                assert isinstance(more, _Append)
                group.append(more)
                size += more.size
            self._commit_group(group)
            if pending_call is not None:
                self._run_call(pending_call)
            if stop_after:
                return

    def _commit_group(self, group: list[_Append]) -> None:
        assert self.conn is not None
        saved = list(self.next_offsets)
        next_offsets = self.next_offsets
        blobs = self.blobs
        assert blobs is not None
        # Per partition: the open segment's first offset, values and size.
        open_segments: dict[int, tuple[int, list[bytes], list[int]]] = {}
        rows: list[tuple[int, int, int | None, bytes]] = []
        results: list[list[Position]] = []
        for request in group:
            positions = []
            for record in request.records:
                partition = record.partition
                offset = next_offsets[partition]
                next_offsets[partition] = offset + 1
                positions.append(Position(partition, offset))
                segment = open_segments.get(partition)
                if segment is not None and segment[2][0] + len(record.value) > _SEGMENT_BYTES:
                    rows.append(_segment_row(partition, segment, blobs))
                    segment = None
                if segment is None:
                    open_segments[partition] = (offset, [record.value], [len(record.value)])
                else:
                    segment[1].append(record.value)
                    segment[2][0] += len(record.value)
            results.append(positions)
        rows.extend(_segment_row(p, segment, blobs) for p, segment in open_segments.items())
        try:
            blobs.flush()  # before the segments that refer to it
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT INTO segments (id, count, blob_file, value) VALUES (?, ?, ?, ?)", rows
            )
            self.conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            self.next_offsets[:] = saved
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            failure = _translate(e, self.path)
            for request in group:
                request.loop.call_soon_threadsafe(_fail, request.future, failure)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for request, positions in zip(group, results, strict=True):
            by_loop.setdefault(request.loop, []).append((request.future, positions))
        for loop, done in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, done)
        self.wal_bytes += sum(len(row[3]) for row in rows)
        if self.wal_bytes >= _CHECKPOINT_BYTES:
            self.wal_bytes = 0
            self.wal_grew.set()
        self.wake_followers()

    def wake_followers(self) -> None:
        with self.waiters_lock:
            waiters, self.waiters = self.waiters, set()
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def _run_call(self, call: _Call) -> None:
        assert self.conn is not None
        try:
            result = call.function(self.conn)
        except sqlite3.Error as e:
            call.loop.call_soon_threadsafe(_fail, call.future, _translate(e, self.path))
        except BaseException as e:  # hand any failure to the caller, keep the writer alive
            call.loop.call_soon_threadsafe(_fail, call.future, e)
        else:
            call.loop.call_soon_threadsafe(_resolve_all, [(call.future, result)])


def _segment_row(
    partition: int, segment: tuple[int, list[bytes], list[int]], blobs: BlobStore
) -> tuple[int, int, int | None, bytes]:
    first, values, _ = segment
    encoded, lowest_blob_file = _encode_segment(values, blobs)
    return _row_id(partition, first), len(values), lowest_blob_file, encoded


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
    """The SQLite-backed log; ``data_dir/log/<run>.sqlite3`` per run."""

    def __init__(
        self,
        data_dir: Path,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        synchronous: str = "FULL",
    ) -> None:
        if synchronous.upper() not in {"FULL", "NORMAL", "EXTRA"}:
            raise InvalidRequest(f"synchronous must be FULL, NORMAL or EXTRA, not {synchronous!r}")
        self.data_dir = Path(data_dir)
        self.url = f"embedded://{self.data_dir}"
        self.max_record_bytes = max_record_bytes
        self.synchronous = synchronous.upper()
        self._runs: dict[str, _RunFile] = {}
        self._lock = asyncio.Lock()
        self._started = False

    @property
    def _log_dir(self) -> Path:
        return self.data_dir / "log"

    def _path(self, run: str) -> Path:
        return self._log_dir / f"{run}.sqlite3"

    async def start(self) -> None:
        await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        self._started = True

    async def close(self) -> None:
        runs, self._runs = list(self._runs.values()), {}
        for run_file in runs:
            await asyncio.to_thread(run_file.stop)
        self._started = False

    async def ensure_run(self, run: str, partitions: int = DEFAULT_PARTITIONS) -> int:
        check_run_name(run)
        if not 1 <= partitions <= _MAX_PARTITIONS:
            raise InvalidRequest(f"partitions must be 1..{_MAX_PARTITIONS}, not {partitions}")
        async with self._lock:
            if run in self._runs:
                return self._runs[run].partitions
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
        if not self._started:
            raise LogError("the embedded log is not started")
        path = self._path(run)
        if partitions is None and not path.exists():
            raise UnknownRun(f"run {run!r} has no log", run=run)
        try:
            conn = _connect(path, self.synchronous)
            try:
                conn.executescript(_SCHEMA)
                conn.execute(
                    "INSERT OR IGNORE INTO settings (name, value) VALUES ('partitions', ?)",
                    (str(partitions),),
                )
                (stored,) = conn.execute(
                    "SELECT value FROM settings WHERE name = 'partitions'"
                ).fetchone()
            finally:
                conn.close()
            run_file = _RunFile(path, int(stored), self.synchronous)
            run_file.open()
        except sqlite3.Error as e:
            raise _translate(e, path) from e
        return run_file

    async def append_records(self, run: str, records: Sequence[Record]) -> list[Position]:
        run_file = await self._run(run)
        if not records:
            return []
        for record in records:
            if not 0 <= record.partition < run_file.partitions:
                raise InvalidRequest(f"partition {record.partition} out of range", run=run)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Position]] = loop.create_future()
        size = sum(len(record.value) for record in records)
        run_file.requests.put(_Append(records, loop, future, size))
        return await future

    async def _call(self, run: str, function: Callable[[sqlite3.Connection], Any]) -> Any:
        run_file = await self._run(run)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        run_file.requests.put(_Call(function, loop, future))
        return await future

    async def read_records(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        async for page in self.read_pages(run, partition, start, end):
            for item in page:
                yield item

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
        reader = await _Reader.open(run_file.path, run_file.synchronous)
        try:
            cursor = await reader.run(_open_range, reader.conn, partition, start, end)
            while True:
                page = await reader.run(_fetch_page, cursor, start, end, run_file.blobs)
                if not page:
                    return
                yield page
        except sqlite3.Error as e:
            raise _translate(e, run_file.path) from e
        finally:
            await reader.close()

    async def follow(
        self, run: str, partition: int, start: int, *, poll_s: float = 0.05
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Pages from ``start`` on; woken by each commit (``poll_s`` is unused here)."""
        run_file = await self._run(run)
        if not 0 <= partition < run_file.partitions:
            raise InvalidRequest(f"partition {partition} out of range", run=run)
        loop = asyncio.get_running_loop()
        reader = await _Reader.open(run_file.path, run_file.synchronous)
        next_offset = max(start, run_file.start_offsets[partition])
        try:
            while True:
                woken = asyncio.Event()
                with run_file.waiters_lock:
                    run_file.waiters.add((loop, woken))
                end = run_file.next_offsets[partition]
                if end <= next_offset:
                    await woken.wait()
                    continue
                with run_file.waiters_lock:
                    run_file.waiters.discard((loop, woken))
                page = await reader.run(
                    _read_range, reader.conn, partition, next_offset, end, run_file.blobs
                )
                if page:
                    next_offset = page[-1][0] + 1
                    yield page
        except sqlite3.Error as e:
            raise _translate(e, run_file.path) from e
        finally:
            await reader.close()

    async def trim(self, run: str, partition: int, before: int) -> bool:
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
                    (_row_id(partition, 0), _row_id(partition, before), _OFFSET_MASK, before),
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
            # Blob files below the lowest one a remaining segment refers to hold nothing live.
            (lowest,) = conn.execute("SELECT min(blob_file) FROM segments").fetchone()
            if run_file.blobs is not None:
                run_file.blobs.delete_below(run_file.blobs.current if lowest is None else lowest)

        await self._call(run, delete)
        return True

    async def end_offsets(self, run: str) -> list[int]:
        return list((await self._run(run)).next_offsets)

    async def start_offsets(self, run: str) -> list[int]:
        """The first offset still held in every partition (after trimming)."""
        return list((await self._run(run)).start_offsets)


class _Reader:
    """A read connection whose blocking calls run in a worker thread. ``close`` waits for a call
    still running there (say, when the reading task was cancelled) before closing the connection
    under it."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._running: asyncio.Future[Any] | None = None

    @classmethod
    async def open(cls, path: Path, synchronous: str) -> _Reader:
        return cls(await asyncio.to_thread(_connect, path, synchronous))

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        self._running = asyncio.ensure_future(asyncio.to_thread(function, *args))
        result = await asyncio.shield(self._running)
        self._running = None
        return result

    async def close(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            with contextlib.suppress(BaseException):
                await running
        self.conn.close()


def _open_range(conn: sqlite3.Connection, partition: int, start: int, end: int) -> sqlite3.Cursor:
    # The first segment may begin before ``start``: begin the scan at the last one that does.
    row = conn.execute(
        "SELECT max(id) FROM segments WHERE id >= ? AND id <= ?",
        (_row_id(partition, 0), _row_id(partition, start)),
    ).fetchone()
    first = row[0] if row[0] is not None else _row_id(partition, start)
    return conn.execute(
        "SELECT id, count, value FROM segments WHERE id >= ? AND id < ? ORDER BY id",
        (first, _row_id(partition, end)),
    )


def _read_range(
    conn: sqlite3.Connection, partition: int, start: int, end: int, blobs: BlobStore
) -> list[tuple[int, bytes]]:
    """The first page of ``[start, end)`` (a follower's step)."""
    return _fetch_page(_open_range(conn, partition, start, end), start, end, blobs)


def _fetch_page(
    cursor: sqlite3.Cursor, start: int, end: int, blobs: BlobStore
) -> list[tuple[int, bytes]]:
    page: list[tuple[int, bytes]] = []
    size = 0
    segments = 0
    while segments < _PAGE_SEGMENTS and size < _PAGE_BYTES:
        row = cursor.fetchone()
        if row is None:
            break
        row_id, count, blob = row
        page.extend(_decode_segment(row_id & _OFFSET_MASK, count, blob, start, end, blobs))
        size += len(blob)
        segments += 1
    return page


def from_url(url: str, **options: Any) -> EmbeddedLog:
    """``embedded:///abs/path`` (or ``embedded://rel/path``), with optional ``?synchronous=``."""
    parts = urlsplit(url)
    path = unquote(parts.netloc + parts.path)
    if not path:
        raise InvalidRequest(f"embedded log URL needs a path: {url!r}")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    if "synchronous" in query:
        options.setdefault("synchronous", query["synchronous"])
    if "max_record_bytes" in query:
        options.setdefault("max_record_bytes", int(query["max_record_bytes"]))
    return EmbeddedLog(Path(path), **options)
