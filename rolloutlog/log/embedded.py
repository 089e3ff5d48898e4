"""The embedded log backend: one SQLite file per run, in WAL mode, under a data directory.

One writer thread per run owns the write connection and commits in groups: every append queued
while the previous transaction was committing shares the next one, so many concurrent appenders
cost one fsync. An append's future resolves only after its group committed (``synchronous=FULL``:
durable across a SIGKILL of the process and across power loss). Readers use their own connections;
WAL lets them read while the writer writes.

A record's row id is ``partition << 40 | offset``, so the table's own primary key orders records by
partition and offset, and a range read is one index range scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from rolloutlog.errors import BackendUnavailable, InvalidRequest, LogError, UnknownRun
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
#: A read page stops at this many bytes or rows, whichever comes first.
_PAGE_BYTES = 8 * 1024 * 1024
_PAGE_ROWS = 4096

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (id INTEGER PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS partitions (
    partition INTEGER PRIMARY KEY,
    start_offset INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _row_id(partition: int, offset: int) -> int:
    return (partition << _OFFSET_BITS) | offset


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
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

    def open(self) -> None:
        conn = _connect(self.path, self.synchronous)
        self.conn = conn
        rows = conn.execute("SELECT partition, start_offset FROM partitions").fetchall()
        starts = dict(rows)
        self.start_offsets = [starts.get(p, 0) for p in range(self.partitions)]
        self.next_offsets = []
        for p in range(self.partitions):
            (last,) = conn.execute(
                "SELECT max(id) FROM records WHERE id >= ? AND id < ?",
                (_row_id(p, 0), _row_id(p + 1, 0)),
            ).fetchone()
            following = 0 if last is None else (last & ((1 << _OFFSET_BITS) - 1)) + 1
            self.next_offsets.append(max(following, self.start_offsets[p]))
        self.thread = threading.Thread(
            target=self._write_loop, name=f"rolloutlog-writer-{self.path.stem}", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.requests.put(_STOP)
            self.thread.join()
            self.thread = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # -- the writer thread ---------------------------------------------------------------------

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
        rows: list[tuple[int, bytes]] = []
        results: list[list[Position]] = []
        for request in group:
            positions = []
            for record in request.records:
                partition = record.partition
                offset = next_offsets[partition]
                next_offsets[partition] = offset + 1
                rows.append(((partition << _OFFSET_BITS) | offset, record.value))
                positions.append(Position(partition, offset))
            results.append(positions)
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany("INSERT INTO records (id, value) VALUES (?, ?)", rows)
            self.conn.execute("COMMIT")
        except sqlite3.Error as e:
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


def _resolve_all(done: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, result in done:
        if not future.done():
            future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _translate(error: sqlite3.Error, path: Path) -> Exception:
    if isinstance(error, sqlite3.OperationalError):
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
        run_file = await self._run(run)
        if not 0 <= partition < run_file.partitions:
            raise InvalidRequest(f"partition {partition} out of range", run=run)
        if end <= start:
            return
        conn = await asyncio.to_thread(_connect, run_file.path, run_file.synchronous)
        try:
            cursor = conn.execute(
                "SELECT id, value FROM records WHERE id >= ? AND id < ? ORDER BY id",
                (_row_id(partition, max(start, 0)), _row_id(partition, end)),
            )
            while True:
                page = await asyncio.to_thread(_fetch_page, cursor)
                if not page:
                    return
                for row_id, value in page:
                    yield row_id & ((1 << _OFFSET_BITS) - 1), value
        except sqlite3.Error as e:
            raise _translate(e, run_file.path) from e
        finally:
            conn.close()

    async def trim(self, run: str, partition: int, before: int) -> bool:
        run_file = await self._run(run)

        def delete(conn: sqlite3.Connection) -> None:
            start = run_file.start_offsets[partition]
            if before <= start:
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "DELETE FROM records WHERE id >= ? AND id < ?",
                    (_row_id(partition, 0), _row_id(partition, before)),
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

        await self._call(run, delete)
        return True

    async def end_offsets(self, run: str) -> list[int]:
        return list((await self._run(run)).next_offsets)

    async def start_offsets(self, run: str) -> list[int]:
        """The first offset still held in every partition (after trimming)."""
        return list((await self._run(run)).start_offsets)


def _fetch_page(cursor: sqlite3.Cursor) -> list[tuple[int, bytes]]:
    page: list[tuple[int, bytes]] = []
    size = 0
    while len(page) < _PAGE_ROWS and size < _PAGE_BYTES:
        rows = cursor.fetchmany(256)
        if not rows:
            break
        page.extend(rows)
        size += sum(len(value) for _, value in rows)
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
