"""Large records of the embedded log, kept outside SQLite.

SQLite writes a committed page twice (the WAL, then the database); for records of hundreds of
kilobytes that halves the throughput. Records of at least ``BLOB_THRESHOLD`` bytes are appended to
plain files instead — ``<run>.blobs/00000000``, rotated every ``ROTATE_BYTES`` — written (and, with
``synchronous=FULL``, fdatasync'ed) before the SQLite transaction that references them commits.
A crash between the two leaves unreferenced bytes at the end of a file, never a reference to
missing bytes. Trimming deletes the files no remaining segment references.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

#: Records at least this large go to a blob file.
BLOB_THRESHOLD = 64 * 1024
#: A blob file is closed for writing once it holds this much.
ROTATE_BYTES = 256 * 1024 * 1024
#: A reference as stored in a segment: file number, position, length.
_REFERENCE = struct.Struct("<IQI")
REFERENCE_BYTES = _REFERENCE.size


class BlobStore:
    """One run's blob files. ``stage`` and ``flush`` belong to the writer thread; ``read`` is safe
    from any thread."""

    def __init__(self, directory: Path, *, sync: bool) -> None:
        self.directory = directory
        self.sync = sync
        directory.mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
        self.current = numbers[-1] if numbers else 0
        self._fd = self._open_for_append(self.current)
        self.position = os.fstat(self._fd).st_size
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._readers: dict[int, int] = {}
        self._lock = threading.Lock()

    def _path(self, number: int) -> Path:
        return self.directory / f"{number:08d}"

    def _open_for_append(self, number: int) -> int:
        return os.open(self._path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def stage(self, value: bytes) -> bytes:
        """Queue ``value`` for the next ``flush``; return the reference a segment stores."""
        if self.position + self._pending_bytes >= ROTATE_BYTES:
            self.flush()
            os.close(self._fd)
            self.current += 1
            self._fd = self._open_for_append(self.current)
            self.position = 0
        reference = _REFERENCE.pack(self.current, self.position + self._pending_bytes, len(value))
        self._pending.append(value)
        self._pending_bytes += len(value)
        return reference

    def flush(self) -> None:
        """Write what was staged (durably, with ``sync``) before the segments that refer to it."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        if self.sync:
            os.fdatasync(self._fd)
        self.position += len(data)
        self._pending.clear()
        self._pending_bytes = 0

    def read(self, reference: bytes | memoryview) -> bytes:
        number, position, length = _REFERENCE.unpack(reference)
        with self._lock:
            fd = self._readers.get(number)
            if fd is None:
                fd = os.open(self._path(number), os.O_RDONLY)
                self._readers[number] = fd
        chunks = []
        while length:
            chunk = os.pread(fd, length, position)
            if not chunk:
                raise OSError(f"blob file {number} ends before {position + length}")
            chunks.append(chunk)
            position += len(chunk)
            length -= len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def delete_below(self, number: int) -> None:
        """Delete the blob files numbered below ``number`` (never the one being written)."""
        for path in self.directory.iterdir():
            if path.name.isdigit() and int(path.name) < min(number, self.current):
                with self._lock:
                    fd = self._readers.pop(int(path.name), None)
                if fd is not None:
                    os.close(fd)
                path.unlink(missing_ok=True)

    def close(self) -> None:
        os.close(self._fd)
        with self._lock:
            readers, self._readers = self._readers, {}
        for fd in readers.values():
            os.close(fd)
