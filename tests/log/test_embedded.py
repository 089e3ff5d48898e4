"""Cases of the embedded backend alone (the shared contract is in tests/contract/test_log.py)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.errors import BackendUnavailable, DataDirLocked, InvalidRequest
from rolloutlog.log import Record, _blobs, open_log
from rolloutlog.log._interface import MAX_PARTITIONS
from rolloutlog.log.embedded import EmbeddedLog
from tests import factories as f
from tests.log._append_forever import BATCH

ROOT = Path(__file__).resolve().parents[2]


def test_urls_and_plain_directories_open_the_embedded_backend(tmp_path: Path) -> None:
    by_url = open_log(f"embedded://{tmp_path}?synchronous=normal")
    assert isinstance(by_url, EmbeddedLog)
    assert by_url.data_dir == tmp_path
    assert by_url.synchronous == "NORMAL"
    by_dir = open_log(tmp_path)
    assert isinstance(by_dir, EmbeddedLog)
    assert by_dir.synchronous == "FULL"


def test_unknown_scheme_and_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        open_log("s3://bucket/x")
    with pytest.raises(InvalidRequest):
        open_log(f"embedded://{tmp_path}?synchronous=off")


async def test_run_file_is_in_wal_mode(tmp_path: Path) -> None:
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 2)
        await log.append("run", [f.started("r1")])
        conn = sqlite3.connect(tmp_path / "log" / "run.sqlite3")
        try:
            (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        finally:
            conn.close()
    assert mode == "wal"


async def test_concurrent_appends_share_transactions(tmp_path: Path) -> None:
    commits = 0
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 2)
        run_file = log._runs["run"]
        original = run_file._commit_group

        def counting(group: list[object]) -> None:
            nonlocal commits
            commits += 1
            original(group)  # type: ignore[arg-type]

        run_file._commit_group = counting  # type: ignore[method-assign]
        await asyncio.gather(*(log.append("run", [f.started(f"r{i}")]) for i in range(200)))
    assert 0 < commits < 200


async def test_append_does_not_block_the_event_loop(tmp_path: Path) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        task = asyncio.create_task(ticker())
        await log.append("run", [f.session_state("r1", state="x" * 4_000_000) for _ in range(4)])
        task.cancel()
    assert ticks > 1


@pytest.mark.parametrize(
    ("state_bytes", "batches"),
    [(2000, 300), (100_000, 40)],
    ids=["in-sqlite", "in-blob-files"],
)
def test_acknowledged_appends_survive_sigkill(
    tmp_path: Path, state_bytes: int, batches: int
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.log._append_forever", str(tmp_path), str(state_bytes)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert proc.stdout is not None
    acknowledged: set[int] = set()
    try:
        while len(acknowledged) < batches:
            line = proc.stdout.readline()
            assert line, "the appender died before acknowledging enough batches"
            acknowledged.add(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Drain what the appender printed before it died: those were acknowledged too.
    acknowledged.update(int(line) for line in proc.stdout.read().split())
    proc.stdout.close()

    async def present() -> Counter[int]:
        counts: Counter[int] = Counter()
        async with open_log(tmp_path) as log:
            ends = await log.end_offsets("run")
            for p, end in enumerate(ends):
                async for _, event in log.read("run", p, 0, end):
                    counts[event.seq // 10] += 1
        return counts

    counts = asyncio.run(present())
    missing = acknowledged - set(counts)
    assert not missing, f"acknowledged batches lost after SIGKILL: {sorted(missing)[:10]}"
    partial = {batch: n for batch, n in counts.items() if n != BATCH}
    assert not partial, f"half-present batches after SIGKILL: {partial}"


async def test_large_records_live_in_blob_files_that_trimming_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_blobs, "ROTATE_BYTES", 300_000)
    blob = "y" * 100_000
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        positions = []
        for i in range(8):
            positions += await log.append("run", [f.session_state("r1", state={"i": i, "b": blob})])
        blob_dir = tmp_path / "log" / "run.blobs"
        files = sorted(p.name for p in blob_dir.iterdir())
        assert len(files) >= 3
        conn = sqlite3.connect(tmp_path / "log" / "run.sqlite3")
        try:
            (stored,) = conn.execute("SELECT sum(length(value)) FROM segments").fetchone()
        finally:
            conn.close()
        assert stored < 8 * 1000  # only references are in SQLite
        assert await log.trim("run", 0, positions[6].offset)
        remaining = sorted(p.name for p in blob_dir.iterdir())
        assert remaining[0] > files[0]
        got = [event async for _, event in log.read("run", 0, 0, positions[-1].offset + 1)]
        assert [e.data.state.value()["i"] for e in got] == [6, 7]
    async with open_log(tmp_path) as log:
        got = [event async for _, event in log.read("run", 0, 0, positions[-1].offset + 1)]
        assert [e.data.state.value()["i"] for e in got] == [6, 7]
        [after] = await log.append("run", [f.session_state("r1", state={"i": 8, "b": blob})])
        assert after.offset == positions[-1].offset + 1


async def _records(pages: AsyncIterator[Sequence[tuple[int, bytes | memoryview]]]) -> list[Any]:
    return [record async for page in pages for record in page]


def test_mapped_copies_are_views_of_one_mapping_of_a_file_with_no_name(tmp_path: Path) -> None:
    """``mapped_copies``: the pieces back byte for byte, as read-only views of one mapping, of
    a file that no directory names; they outlive the call and the pieces."""
    pieces = [os.urandom(70_000), b"", os.urandom(5), bytearray(os.urandom(200_000))]
    expected = [bytes(p) for p in pieces]
    views = _blobs.mapped_copies([memoryview(p) for p in pieces], str(tmp_path))
    assert len({id(v.obj) for v in views if len(v)}) == 1 and all(v.readonly for v in views)
    assert list(tmp_path.iterdir()) == []
    pieces[3][:] = b"z" * 200_000
    del pieces
    assert [bytes(v) for v in views] == expected


@pytest.mark.parametrize("fault", ["file size limit", "missing directory"])
def test_mapped_copies_a_disk_refuses_raise_and_leave_nothing(tmp_path: Path, fault: str) -> None:
    """A write the kernel refuses (the process's file size limit, ``EFBIG``, as a full disk's
    ``ENOSPC``) or a directory that is gone: ``OSError``, and no file left behind."""
    directory = tmp_path / ("gone" if fault == "missing directory" else "spill")
    if fault == "file size limit":
        directory.mkdir()
    script = (
        "import resource, sys\n"
        "from rolloutlog.log import mapped_copies\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    mapped_copies([b'x' * 80_000, b'y' * 80_000], sys.argv[1])\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=60
    )
    expected = errno.EFBIG if fault == "file size limit" else errno.ENOENT
    assert done.stdout.split() == ["refused", str(expected)], done.stderr
    if directory.exists():
        assert list(directory.iterdir()) == []


async def test_large_records_read_in_place_are_views_of_one_mapping_per_blob_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_pages_in_place`` gives ``read_pages``' records byte for byte, the large ones as
    read-only views: one mapping per blob file, mapped again once the file grew past it, and
    every view readable after the run is trimmed, deleted and the log closed."""
    monkeypatch.setattr(_blobs, "ROTATE_BYTES", 300_000)  # three 100 KB records a file
    blob = "z" * 100_000
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        for i in range(4):
            events = [f.session_state("r1", state={"i": i, "b": blob}), f.session_state("r1")]
            await log.append("run", events)
        early = await _records(log.read_pages_in_place("run", 0, 0, 8))
        for i in range(4, 6):
            events = [f.session_state("r1", state={"i": i, "b": blob}), f.session_state("r1")]
            await log.append("run", events)
        copied = await _records(log.read_pages("run", 0, 0, 12))
        in_place = await _records(log.read_pages_in_place("run", 0, 0, 12))
        assert [(offset, bytes(value)) for offset, value in in_place] == copied
        views = [value for _, value in in_place[::2]]
        assert all(type(view) is memoryview and view.readonly for view in views)
        assert all(type(value) is bytes for _, value in in_place[1::2])  # small: in SQLite
        assert views[0].obj is views[1].obj is views[2].obj  # the first file's
        # The second file was mapped when it held one record (the early read's view keeps that
        # mapping, and reads of the record reuse it); the records past it map it again.
        assert views[3].obj is early[6][1].obj
        assert views[4].obj is views[5].obj is not views[3].obj
        assert await log.trim("run", 0, 10)  # deletes the first file
        assert await log.delete_run("run")
    assert not (tmp_path / "log" / "run.blobs").exists()
    assert [bytes(view) for view in views] == [value for _, value in copied[::2]]


def test_a_blob_reference_past_its_files_end_is_an_error_never_a_crash(tmp_path: Path) -> None:
    """A blob file cut short (by something other than the log) fails the read with ``OSError``,
    in place or not, and through a mapping made before the cut too: never ``SIGBUS``."""
    store = _blobs.BlobStore(tmp_path, sync=False)
    reference = store.stage(b"x" * 200_000)
    store.flush()
    store.close()
    view = store.view(reference)
    assert view == b"x" * 200_000
    os.truncate(tmp_path / "00000000", 50_000)
    with pytest.raises(OSError):
        store.view(reference)  # the mapping made before the cut, still alive
    del view  # (its pages past the cut are gone: never touched again)
    fresh = _blobs.BlobStore(tmp_path, sync=False)
    with pytest.raises(OSError, match="ends before"):
        fresh.view(reference)
    with pytest.raises(OSError, match="ends before"):
        fresh.read(reference)


@pytest.mark.parametrize("seed", [1, 2])
async def test_page_reads_cancelled_while_a_page_is_fetched_end_cleanly(
    tmp_path: Path, seed: int
) -> None:
    """A page read (a restore's prepare, say) cancelled while its worker thread fetches a page
    closes its cursor only after that fetch: 300 cancellations at random moments (seeded: the
    schedule replays from the seed in the test's id), and every one ends as cancelled, never
    with sqlite3's "recursive use of cursors" (nor, with worse timing, a crashed process); the
    reads after them are whole."""
    rng = random.Random(seed)
    print(f"seed {seed}")
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        body = b'{"v":1,"episode":"r1","type":"step.started","data":{}}\n' + b"x" * 3000
        for _ in range(10):
            await log.append_records("run", [Record(0, None, body) for _ in range(2000)])
        reads = [log.read_pages, log.read_pages_in_place]

        async def read(index: int) -> int:
            return sum([len(page) async for page in reads[index % 2]("run", 0, 0, 20_000)])

        for index in range(300):
            task = asyncio.create_task(read(index))
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert [await read(0), await read(1)] == [20_000, 20_000]


async def test_a_blob_file_cut_short_fails_the_reads_of_its_record_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's first blob file cut short under a running log: a read of its record fails
    (``unavailable``, naming the file), copied or in place, again and again; the record in the
    next file reads, and appends go on and read back."""
    monkeypatch.setattr(_blobs, "ROTATE_BYTES", 100_000)  # a file per 100 KB record
    blob = "c" * 100_000
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        for i in range(2):
            await log.append("run", [f.session_state("r1", state={"i": i, "b": blob})])
        os.truncate(tmp_path / "log" / "run.blobs" / "00000000", 50_000)
        for _ in range(2):
            for read in (log.read_pages, log.read_pages_in_place):
                with pytest.raises(BackendUnavailable, match="ends before"):
                    await _records(read("run", 0, 0, 2))
        [(offset, record)] = await _records(log.read_pages_in_place("run", 0, 1, 2))
        assert offset == 1 and b'"i":1' in bytes(record)
        [after] = await log.append("run", [f.session_state("r1", state={"i": 2, "b": blob})])
        got = [event async for _, event in log.read("run", 0, after.offset, after.offset + 1)]
        assert [event.data.state.value()["i"] for event in got] == [2]


async def test_a_second_log_on_a_locked_data_dir_is_refused(tmp_path: Path) -> None:
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        with pytest.raises(DataDirLocked) as refused:
            await open_log(tmp_path).start()
        assert str(os.getpid()) in refused.value.message
    async with open_log(tmp_path) as log:  # released by close
        assert await log.partitions("run") == 1


async def test_a_blob_write_failing_part_way_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = os.pwrite
    failing = True

    def half_then_full(fd: int, data: bytes | memoryview, position: int) -> int:
        if failing and len(data) > 1000:
            real_pwrite(fd, bytes(data[: len(data) // 2]), position)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(_blobs.os, "pwrite", half_then_full)
    states = [{"i": i, "b": os.urandom(50_000).hex()} for i in range(3)]
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        with pytest.raises(BackendUnavailable):
            await log.append("run", [f.session_state("r1", state=states[0])])
        assert await log.end_offsets("run") == [0]
        failing = False
        for state in states[1:]:
            await log.append("run", [f.session_state("r1", state=state)])
        got = [event.data.state.value() async for _, event in log.read("run", 0, 0, 2)]
        assert got == states[1:]
    async with open_log(tmp_path) as log:
        got = [event.data.state.value() async for _, event in log.read("run", 0, 0, 2)]
        assert got == states[1:]


async def test_follow_run_holds_no_connection_while_it_waits(tmp_path: Path) -> None:
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 4)
        await log.append("run", [f.started(f"r{i}") for i in range(8)])
        pages = log.follow_run("run", [0] * 4)
        seen = 0
        while seen < 8:
            _, page = await anext(pages)
            seen += len(page)
        run_file = log._runs["run"]
        # Between steps the reader is back in the pool: none is borrowed.
        assert run_file.reader_slots._value == 4
        await pages.aclose()


async def test_a_run_wider_than_the_limit_made_before_it_still_opens(tmp_path: Path) -> None:
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await asyncio.to_thread(log._open_run, "legacy", MAX_PARTITIONS + 44)  # as before the limit
    async with open_log(tmp_path) as log:
        assert await log.ensure_run("legacy", MAX_PARTITIONS + 44) == MAX_PARTITIONS + 44
        with pytest.raises(InvalidRequest):
            await log.ensure_run("new", MAX_PARTITIONS + 1)


async def test_a_missing_blob_directory_refuses_the_append_and_the_writer_lives_on(
    tmp_path: Path,
) -> None:
    state = {"b": os.urandom(50_000).hex()}
    async with open_log(tmp_path) as log:
        await log.ensure_run("run", 1)
        blobs = tmp_path / "log" / "run.blobs"
        away = blobs.with_name("run.blobs.away")
        blobs.rename(away)
        async with asyncio.timeout(30):
            with pytest.raises(BackendUnavailable):
                await log.append("run", [f.session_state("r1", state=state)])
            away.rename(blobs)
            [position] = await log.append("run", [f.session_state("r1", state=state)])
        assert position.offset == 0
        [(_, event)] = [item async for item in log.read("run", 0, 0, 1)]
        assert event.data.state.value() == state


async def test_a_read_only_log_reads_beside_the_holder_and_refuses_writes(tmp_path: Path) -> None:
    async with open_log(f"embedded://{tmp_path}") as holder:
        await holder.ensure_run("run", 2)
        positions = await holder.append("run", [f.started("r1"), f.started("r2")])
        async with open_log(f"embedded://{tmp_path}?read_only=1") as reader:
            for position in positions:
                got = [o async for o, _ in reader.read_records("run", position.partition, 0, 10)]
                assert position.offset in got
            with pytest.raises(InvalidRequest):
                await reader.append("run", [f.started("r3")])
            with pytest.raises(InvalidRequest):
                await reader.ensure_run("other", 2)
            with pytest.raises(InvalidRequest):
                await reader.trim("run", 0, 1)
        # The holder still holds the data dir: a writer is refused.
        with pytest.raises(DataDirLocked):
            async with open_log(f"embedded://{tmp_path}"):
                pass


async def test_a_follower_at_the_tip_takes_the_committed_records_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutlog.log import Record, _run_file, embedded

    reads: list[list[tuple[int, int, int]]] = []
    read_ranges = embedded.read_ranges

    def counted(
        conn: sqlite3.Connection, ranges: list[tuple[int, int, int]], blobs: object
    ) -> object:
        reads.append(ranges)
        return read_ranges(conn, ranges, blobs)  # type: ignore[arg-type]

    monkeypatch.setattr(embedded, "read_ranges", counted)
    monkeypatch.setattr(_run_file, "_TAIL_BYTES", 4 * 1000)  # 1,000 bytes a partition
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 4)
        pages = log.follow_run("run", [0] * 4)
        got: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(4)}

        async def take(count: int) -> None:
            while sum(map(len, got.values())) < count:
                partition, page = await anext(pages)
                got[partition] += page

        def batch(start: int, size: int) -> list[Record]:
            return [Record(i % 4, None, b"v%d" % i * size) for i in range(start, start + 40)]

        await log.append_records("run", batch(0, 10))  # 20-30 bytes a record: in the tails
        await take(40)
        assert reads == []
        await log.append_records("run", batch(40, 100))  # 10 x 300+ bytes a partition: too big
        await take(80)
        assert len(reads) == 1
        await log.trim("run", 0, 85)  # past partition 0's end: its offsets jump, its tail empties
        assert log._runs["run"].tail[0] == []
        await log.append_records("run", batch(80, 1))
        await take(120)
        # Partitions 1-3 from their tails again; partition 0's follower is behind its new start.
        assert {tuple(p for p, _, _ in ranges) for ranges in reads[1:]} == {(0,)}
        for partition, items in got.items():  # what the file holds (partition 0: from 85 on)
            stored = [item async for item in log.read_records("run", partition, 0, 1000)]
            assert [item for item in items if item[0] >= stored[0][0]] == stored
            assert [offset for offset, _ in items] == sorted({offset for offset, _ in items})
        assert [offset for offset, _ in got[0]] == [*range(20), *range(85, 95)]
        # A record kept in a blob file is read from there: its partition's tail starts after it.
        await log.append_records("run", [Record(1, None, b"b" * _blobs.BLOB_THRESHOLD)])
        await take(121)
        assert reads[-1] == [(1, 30, 31)] and log._runs["run"].tail[1] == []
        await pages.aclose()


async def test_the_tail_holds_records_in_memory_of_their_length(tmp_path: Path) -> None:
    """The tail is counted by record length, so it keeps copies that fit: an ``orjson.dumps``
    result sits in a 4 KB buffer however short it is (30,000 small records held 127 MB before,
    9 MB after)."""
    import gc
    import tracemalloc

    import orjson

    from rolloutlog.log._interface import Record

    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 4)
        tracemalloc.start()
        try:
            records = [
                Record(i % 4, None, orjson.dumps({"type": "step.boundary", "seq": i}))
                for i in range(2000)
            ]
            await log.append_records("run", records)
            held = sum(len(tail) for tail in log._runs["run"].tail)
            del records
            # The writer thread resolves the append's future before its commit function returns
            # (its frame still holds the group for a moment): the bytes are let go within a
            # short wait, or they are kept.
            for _ in range(100):
                gc.collect()  # the append's request objects may sit in a cycle (its future)
                # What this file allocated and the tail still holds: the records as appended.
                made_here = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(True, __file__)]
                )
                kept = sum(stat.size for stat in made_here.statistics("filename"))
                if kept < 1_000_000:
                    break
                await asyncio.sleep(0.02)
        finally:
            tracemalloc.stop()
    assert held == 2000
    assert kept < 1_000_000, kept  # the copies fit; the appended bytes (2,000 x 4 KB) are gone


async def test_a_commit_group_cuts_a_partitions_records_into_segments_at_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutlog.log import Record, _segments

    monkeypatch.setattr(_segments, "SEGMENT_BYTES", 100)
    values = [b"%030d" % i for i in range(10)] + [b"b" * 150, b"c" * 30]
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 2)
        await log.append_records("run", [Record(0, None, value) for value in values])
        await log.append_records("run", [Record(1, None, b"one")])
        conn = sqlite3.connect(log._runs["run"].path)
        counts = [count for (count,) in conn.execute("SELECT count FROM segments ORDER BY id")]
        conn.close()
        # 3 x 30 bytes fit 100, a 4th does not; the big record is a segment of its own.
        assert counts == [3, 3, 3, 1, 1, 1, 1]
        stored = [item async for item in log.read_records("run", 0, 0, 100)]
        assert stored == list(enumerate(values))


async def test_a_full_tail_keeps_the_newest_records_that_fit_half_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutlog.log import Record, _run_file

    monkeypatch.setattr(_run_file, "_TAIL_BYTES", 2 * 1000)  # 1,000 bytes a partition
    async with open_log(tmp_path) as log:
        assert isinstance(log, EmbeddedLog)
        await log.ensure_run("run", 2)
        run_file = log._runs["run"]
        await log.append_records("run", [Record(0, None, b"x" * 30) for _ in range(30)])
        assert len(run_file.tail[0]) == 30 and run_file.tail_bytes[0] == 900
        await log.append_records("run", [Record(0, None, b"y" * 30) for _ in range(5)])
        # 1,050 bytes: trimmed once to at most 500 (the newest 16), not to 1,000 each group.
        assert [offset for offset, _ in run_file.tail[0]] == list(range(19, 35))
        assert run_file.tail_bytes[0] == 480
        assert run_file.from_tail(0, 30, 35) == [(offset, b"y" * 30) for offset in range(30, 35)]
