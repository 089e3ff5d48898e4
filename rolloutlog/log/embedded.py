"""The embedded log backend: one SQLite file per run, in WAL mode, under a data directory.

A run file's requests queue up and one thread of a small shared pool drains them in commit groups:
every append queued while the previous transaction was committing shares the next one, so many
concurrent appenders cost one fsync. An append's future resolves only after its group committed
(``synchronous=FULL``: durable across a SIGKILL of the process and across power loss). Readers use
their own connections; WAL lets them read while the writer writes.

Records are stored in *segments*, like Kafka's record batches (``_segments``): a group of
thousands of small events costs a few row inserts instead of thousands. A committed group's
records also stay in memory as each partition's *tail* (its newest records, ``_TAIL_BYTES`` a
run, ``_run_file``): a follower at the tip (the projector) takes them from there rather than reading back and
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
import shutil
import sqlite3
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from rolloutlog.errors import (
    ConfigurationError,
    InvalidRequest,
    LogError,
    UnknownRun,
)
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
from rolloutlog.log._run_file import (
    Append,
    RunCall,
    RunFile,
    Writers,
    open_files_budget,
    translate,
)
from rolloutlog.log._segments import (
    OFFSET_MASK,
    R,
    fetch_page,
    open_range,
    read_ranges,
    read_run_file,
    row_id,
)

__all__ = ["EmbeddedLog", "from_url"]


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
        self._runs: dict[str, RunFile] = {}
        self._lock = asyncio.Lock()
        self._writers: Writers | None = None
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
            self._writers = Writers(open_files_budget())
            return
        self._data_dir_lock = await asyncio.to_thread(DataDirLock.acquire, self.data_dir)
        try:
            await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        except OSError as e:
            self._data_dir_lock.release()
            self._data_dir_lock = None
            raise translate(e, self._log_dir) from e
        self._writers = Writers(open_files_budget())

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

    async def _run(self, run: str) -> RunFile:
        run_file = self._runs.get(run)
        if run_file is not None:
            return run_file
        check_run_name(run)
        async with self._lock:
            if run not in self._runs:
                opened = await asyncio.to_thread(self._open_run, run, None)
                self._runs[run] = opened
            return self._runs[run]

    def _open_run(self, run: str, partitions: int | None) -> RunFile:
        writers = self._writers
        if writers is None:
            raise LogError("the embedded log is not started")
        path = self._path(run)
        if partitions is None and not path.exists():
            raise UnknownRun(f"run {run!r} has no log", run=run)
        try:
            count, start_offsets, next_offsets = read_run_file(path, partitions, self.synchronous)
            return RunFile(
                path,
                count,
                self.synchronous,
                writers,
                start_offsets=start_offsets,
                next_offsets=next_offsets,
            )
        except (sqlite3.Error, OSError) as e:
            raise translate(e, path) from e

    async def delete_run(self, run: str) -> bool:
        """Delete the run's file and blob files; appends queued before fail with ``UnknownRun``
        and its followers end with it. False when the run had no log."""
        self._check_writable()
        check_run_name(run)
        async with self._lock:
            found = self._runs.pop(run, None)
            try:
                run_file: RunFile = (
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
            run_file.submit(RunCall(mark_deleted, loop, future))
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
        run_file.submit(Append(records, loop, future, size))
        return await future

    async def _call(self, run: str, function: Callable[[sqlite3.Connection], Any]) -> Any:
        run_file = await self._run(run)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        run_file.submit(RunCall(function, loop, future))
        return await future

    async def read_pages(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Like ``read_records``, a page (list) at a time: cheaper for bulk replays."""
        run_file = await self._run(run)
        async for page in _pages(run, run_file, partition, start, end, run_file.blobs.read):
            yield page

    async def read_pages_in_place(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[Sequence[tuple[int, bytes | memoryview]]]:
        """``read_pages`` with its large records as views of their blob files' mappings
        (``BlobStore.view``)."""
        run_file = await self._run(run)
        async for page in _pages(run, run_file, partition, start, end, run_file.blobs.view):
            yield page

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
        self, run_file: RunFile, starts: Sequence[int], partitions: set[int]
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
            raise translate(e, run_file.path) from e

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


async def _pages(
    run: str,
    run_file: RunFile,
    partition: int,
    start: int,
    end: int,
    read: Callable[[memoryview], R],
) -> AsyncIterator[list[tuple[int, bytes | R]]]:
    """A range read's pages (``read_pages``), its large records read by ``read``."""
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
                    page = await reader.run(fetch_page, cursor, start, end, read)
                    if not page:
                        return
                    yield page
            finally:
                await reader.run(cursor.close)  # ends the read transaction
    except (sqlite3.Error, OSError) as e:
        raise translate(e, run_file.path) from e


def _delete_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.rmtree(path.with_suffix(".blobs"), ignore_errors=True)


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
