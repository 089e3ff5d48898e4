"""The embedded log's storage format: one SQLite file per run, records in *segments*.

A segment is the records of one partition that one commit group appended (split at
``SEGMENT_BYTES``), stored as one row whose id is ``partition << 40 | first offset``: the table's
own primary key orders segments by partition and offset, a range read is one index range scan.
A segment's value is ``count`` little-endian uint32 lengths, then the records; a length with the
high bit set marks a record kept in a blob file (``_blobs``), whose body is its reference.
"""

from __future__ import annotations

import array
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rolloutlog.log._blobs import BLOB_THRESHOLD, BlobStore

_OFFSET_BITS = 40

#: A segment stops growing at this many bytes (a larger record is a segment of its own).
SEGMENT_BYTES = 1024 * 1024
#: A read page stops at this many bytes or segments, whichever comes first.
PAGE_BYTES = 8 * 1024 * 1024
_PAGE_SEGMENTS = 64

OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"
#: What a page's large records are read as (``bytes``, or ``memoryview`` in place).
R = TypeVar("R", bytes, memoryview)

SCHEMA = """
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


def row_id(partition: int, offset: int) -> int:
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
    first: int, count: int, blob: bytes, start: int, end: int, read: Callable[[memoryview], R]
) -> list[tuple[int, bytes | R]]:
    """The records of a segment whose offsets fall in ``[start, end)``, its large ones read from
    their references by ``read`` (``BlobStore.read``, or ``BlobStore.view`` in place)."""
    lengths = array.array("I")
    lengths.frombytes(blob[: 4 * count])
    if not _LITTLE_ENDIAN:
        lengths.byteswap()
    view = memoryview(blob)
    position = 4 * count
    out: list[tuple[int, bytes | R]] = []
    for index, length in enumerate(lengths):
        offset = first + index
        size = length & ~_EXTERNAL
        if start <= offset < end:
            body = view[position : position + size]
            out.append((offset, read(body) if length & _EXTERNAL else bytes(body)))
        position += size
    return out


def connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    # Small pages: a commit rewrites the last leaf page of every partition it appends to, and
    # big payloads cost little more in 4 KiB overflow pages (the WAL is copied off-thread).
    conn.execute("PRAGMA page_size=4096")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    # WAL checkpoints copy every committed byte a second time; ``_Writers.checkpoint`` does that
    # beside the writer instead of inside whichever commit crosses the threshold.
    conn.execute("PRAGMA wal_autocheckpoint=0")
    return conn


def segment_row(
    partition: int, segment: tuple[int, list[bytes]], blobs: BlobStore
) -> tuple[int, int, int | None, bytes]:
    first, values = segment
    encoded, lowest_blob_file = _encode_segment(values, blobs)
    return row_id(partition, first), len(values), lowest_blob_file, encoded


def split_segments(first: int, values: list[bytes]) -> list[tuple[int, list[bytes]]]:
    """A partition's consecutive records (from offset ``first``) as segments: a segment stops
    growing before ``SEGMENT_BYTES`` (a larger record is a segment of its own)."""
    sizes = list(map(len, values))
    total = sum(sizes)
    if total <= SEGMENT_BYTES:
        return [(first, values)]
    segments = []
    start = size = 0
    for index, length in enumerate(sizes):
        if index > start and size + length > SEGMENT_BYTES:
            segments.append((first + start, values[start:index]))
            start, size = index, 0
        size += length
    segments.append((first + start, values[start:]))
    return segments


def read_run_file(
    path: Path, partitions: int | None, synchronous: str
) -> tuple[int, list[int], list[int]]:
    """Create the file's schema if needed; its partition count, start and next offsets."""
    conn = connect(path, synchronous)
    try:
        conn.executescript(SCHEMA)
        conn.execute(
            "INSERT OR IGNORE INTO settings (name, value) VALUES ('partitions', ?)",
            (str(partitions),),
        )
        (stored,) = conn.execute("SELECT value FROM settings WHERE name = 'partitions'").fetchone()
        count = int(stored)
        starts = dict(conn.execute("SELECT partition, start_offset FROM partitions").fetchall())
        start_offsets = [starts.get(p, 0) for p in range(count)]
        next_offsets = []
        for p in range(count):
            last = conn.execute(
                "SELECT id, count FROM segments WHERE id >= ? AND id < ? ORDER BY id DESC LIMIT 1",
                (row_id(p, 0), row_id(p + 1, 0)),
            ).fetchone()
            following = 0 if last is None else (last[0] & OFFSET_MASK) + last[1]
            next_offsets.append(max(following, start_offsets[p]))
    finally:
        conn.close()
    return count, start_offsets, next_offsets


def open_range(conn: sqlite3.Connection, partition: int, start: int, end: int) -> sqlite3.Cursor:
    # The first segment may begin before ``start``: begin the scan at the last one that does.
    row = conn.execute(
        "SELECT max(id) FROM segments WHERE id >= ? AND id <= ?",
        (row_id(partition, 0), row_id(partition, start)),
    ).fetchone()
    first = row[0] if row[0] is not None else row_id(partition, start)
    return conn.execute(
        "SELECT id, count, value FROM segments WHERE id >= ? AND id < ? ORDER BY id",
        (first, row_id(partition, end)),
    )


def read_range(
    conn: sqlite3.Connection, partition: int, start: int, end: int, blobs: BlobStore
) -> list[tuple[int, bytes]]:
    """The first page of ``[start, end)`` (a follower's step)."""
    cursor = open_range(conn, partition, start, end)
    try:
        return fetch_page(cursor, start, end, blobs.read)
    finally:
        cursor.close()  # ends the read transaction before the connection goes back to the pool


def read_ranges(
    conn: sqlite3.Connection, ranges: list[tuple[int, int, int]], blobs: BlobStore
) -> list[tuple[int, list[tuple[int, bytes]]]]:
    """A follower's step over several partitions: each one's first page, ``PAGE_BYTES`` in
    all at most (partitions left out are still behind, so the next step reads them)."""
    pages: list[tuple[int, list[tuple[int, bytes]]]] = []
    size = 0
    for partition, start, end in ranges:
        page = read_range(conn, partition, start, end, blobs)
        if page:
            pages.append((partition, page))
            size += sum(len(value) for _, value in page)
            if size >= PAGE_BYTES:
                break
    return pages


def fetch_page(
    cursor: sqlite3.Cursor, start: int, end: int, read: Callable[[memoryview], R]
) -> list[tuple[int, bytes | R]]:
    """The next page of a range read (``open_range``), its large records read by ``read``."""
    page: list[tuple[int, bytes | R]] = []
    size = 0
    segments = 0
    while segments < _PAGE_SEGMENTS and size < PAGE_BYTES:
        row = cursor.fetchone()
        if row is None:
            break
        row_id, count, blob = row
        page.extend(_decode_segment(row_id & OFFSET_MASK, count, blob, start, end, read))
        size += len(blob)
        segments += 1
    return page
