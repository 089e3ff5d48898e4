"""Large records of the embedded log, kept outside SQLite.

SQLite writes a committed page twice (the WAL, then the database); for records of hundreds of
kilobytes that halves the throughput. Records of at least ``BLOB_THRESHOLD`` bytes are appended to
plain files instead — ``<run>.blobs/00000000``, rotated every ``ROTATE_BYTES`` — written (and, with
``synchronous=FULL``, fdatasync'ed) before the SQLite transaction that references them commits.
A crash between the two leaves unreferenced bytes at the end of a file, never a reference to
missing bytes. Trimming deletes the files no remaining segment references.

Writes go to explicit positions (``pwrite``), never "wherever the file ends now". A commit group
takes a ``mark`` first; if anything fails (a full disk part-way through a record, or the SQLite
commit after it), ``rollback`` cuts the files back to the mark, and even when that cut fails
too, the next write lands where its reference says: no later record can be read through bytes
a failed one left behind.

File descriptors are held only while needed: the append descriptor opens at the first large
record and ``close`` releases it; a read opens, reads and closes (a large record costs far more
than an ``open``), so an idle run holds none.

``view`` reads a record in place instead: a read-only view of a shared mapping of its file, for
a restore's composition, whose lines carry large states as views of their records to the
socket (docs/design.md §11, "A large state is read in place"). A ``read`` copies the record into
fresh memory, a page fault per 4 KiB (a restore of 1,000 350 KB states: ~88k faults, about half
of the service's CPU for the restore and its fetch); a view maps the page cache's own pages. A file has
at most one live mapping, as long as a view of it lives (``weakref``); a record past its end is
read through a new one. The mapping never reaches past a record the file holds whole, and its
pages are faulted in at once (``MADV_POPULATE_READ``, Linux 5.14), so a read error is an
``OSError`` there, as ``read``'s is, not a ``SIGBUS`` on a later access.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

#: Records at least this large go to a blob file.
BLOB_THRESHOLD = 64 * 1024
#: A blob file is closed for writing once it holds this much.
ROTATE_BYTES = 256 * 1024 * 1024
#: A reference as stored in a segment: file number, position, length.
_REFERENCE = struct.Struct("<IQI")
REFERENCE_BYTES = _REFERENCE.size
#: madvise's "fault these pages in now, report failures" (Linux 5.14; EINVAL before).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform == "linux" else None


class Mark(NamedTuple):
    """Where the blob files ended when a commit group began."""

    number: int
    position: int


class BlobStore:
    """One run's blob files. Everything but ``read`` belongs to the run's writer; ``read`` is
    safe from any thread."""

    def __init__(self, directory: Path, *, sync: bool) -> None:
        self.directory = directory
        self.sync = sync
        directory.mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
        self.current = numbers[-1] if numbers else 0
        current = self._path(self.current)
        #: Where the next staged record goes. Bytes past it (a crash between a blob write and
        #: its segment's commit) are referenced by nothing and get overwritten.
        self.position = current.stat().st_size if current.exists() else 0
        self._fd: int | None = None
        self._fd_number = -1
        #: Staged records: (file number, position, value).
        self._pending: list[tuple[int, int, bytes]] = []
        #: Per file, its mapping while a view of it lives (``view``); the lock is the readers'.
        self._mappings: dict[int, weakref.ref[mmap.mmap]] = {}
        self._mappings_lock = threading.Lock()

    def _path(self, number: int) -> Path:
        return self.directory / f"{number:08d}"

    def mark(self) -> Mark:
        return Mark(self.current, self.position)

    def stage(self, value: bytes) -> bytes:
        """Queue ``value`` for the next ``flush``; return the reference a segment stores."""
        if self.position >= ROTATE_BYTES:
            self.current += 1
            self.position = 0
        reference = _REFERENCE.pack(self.current, self.position, len(value))
        self._pending.append((self.current, self.position, value))
        self.position += len(value)
        return reference

    def flush(self) -> None:
        """Write what was staged (durably, with ``sync``) before the segments that refer to it."""
        pending, self._pending = self._pending, []
        for index, (number, position, value) in enumerate(pending):
            fd = self._writer(number)
            _write_all(fd, value, position)
            last_of_file = index + 1 == len(pending) or pending[index + 1][0] != number
            if last_of_file and self.sync:
                os.fdatasync(fd)

    def _writer(self, number: int) -> int:
        if self._fd_number != number:
            self.close()
            self._fd = os.open(self._path(number), os.O_WRONLY | os.O_CREAT, 0o644)
            self._fd_number = number
        assert self._fd is not None
        return self._fd

    def rollback(self, mark: Mark) -> None:
        """Forget what was staged or written since ``mark`` and give its space back (best
        effort: positions alone already keep later records apart from it)."""
        self._pending.clear()
        self.close()
        self.current, self.position = mark
        # Never raises: it runs while a failure (maybe of this very directory) is reported.
        with contextlib.suppress(OSError):
            os.truncate(self._path(mark.number), mark.position)
        with contextlib.suppress(OSError):
            for path in self.directory.iterdir():
                if path.name.isdigit() and int(path.name) > mark.number:
                    path.unlink(missing_ok=True)

    def read(self, reference: bytes | memoryview) -> bytes:
        number, position, length = _REFERENCE.unpack(reference)
        fd = os.open(self._path(number), os.O_RDONLY)
        try:
            chunks = []
            while length:
                chunk = os.pread(fd, length, position)
                if not chunk:
                    raise OSError(f"blob file {number} ends before {position + length}")
                chunks.append(chunk)
                position += len(chunk)
                length -= len(chunk)
        finally:
            os.close(fd)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def view(self, reference: bytes | memoryview) -> memoryview:
        """The record ``reference`` names, read in place: a read-only view of its file's mapping
        (the module's docstring). Safe from any thread."""
        number, position, length = _REFERENCE.unpack(reference)
        end = position + length
        with self._mappings_lock:
            found = self._mappings.get(number)
            mapped = found() if found is not None else None
            if mapped is None or len(mapped) < end:
                mapped = self._map(number, end)
                self._mappings[number] = weakref.ref(mapped)
        _populate(mapped, position, end)
        return memoryview(mapped)[position:end]

    def _map(self, number: int, end: int) -> mmap.mmap:
        """A read-only mapping of blob file ``number`` as far as it is written now (at least to
        ``end``: a reference past the file's end is an error, never a mapping of missing
        pages)."""
        fd = os.open(self._path(number), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < end:
                raise OSError(errno.EIO, f"blob file {number} ends before {end}")
            return mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def delete_below(self, number: int) -> None:
        """Delete the blob files numbered below ``number`` (never the one being written)."""
        for path in self.directory.iterdir():
            if path.name.isdigit() and int(path.name) < min(number, self.current):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the append descriptor (the next ``flush`` opens it again)."""
        fd, self._fd, self._fd_number = self._fd, None, -1
        if fd is not None:
            os.close(fd)


def mapped_copies(pieces: Sequence[bytes | memoryview], directory: str | None) -> list[memoryview]:
    """``pieces`` copied into a file of their own and read back in place: read-only views of
    one mapping, as ``BlobStore.view`` gives (its pages faulted in at once), of a file with no
    name (``O_TMPFILE`` in ``directory``, the temporary directory by default). The page cache
    holds the bytes, not the heap; the file's space is the mapping's and is freed with its
    last view, or with the process, however it ends. Raises ``OSError`` (a full disk, a
    missing directory) with nothing left behind."""
    total = sum(len(piece) for piece in pieces)
    with tempfile.TemporaryFile(dir=directory) as file:
        fd, position = file.fileno(), 0
        for piece in pieces:
            _write_all(fd, piece, position)
            position += len(piece)
        mapped = mmap.mmap(fd, total, prot=mmap.PROT_READ) if total else None
    if mapped is None:
        return [memoryview(b"") for _ in pieces]
    _populate(mapped, 0, total)
    whole, views, position = memoryview(mapped), [], 0
    for piece in pieces:
        views.append(whole[position : position + len(piece)])
        position += len(piece)
    return views


def _write_all(fd: int, value: bytes | memoryview, position: int) -> None:
    view = memoryview(value)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written


def _populate(mapped: mmap.mmap, start: int, end: int) -> None:
    """Fault in the pages of ``[start, end)`` now: a read error is an ``OSError`` here rather than
    a ``SIGBUS`` when the bytes are used. Kernels before 5.14 (``EINVAL``) and other systems
    fault them in as they are read."""
    if _POPULATE_READ is None or end <= start:
        return
    first = start - start % mmap.PAGESIZE
    try:
        mapped.madvise(_POPULATE_READ, first, end - first)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
