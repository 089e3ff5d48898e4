"""The embedded data directory's lock: one process at a time may write under it.

An OS file lock (``flock``) on ``<data dir>/lock``: the kernel releases it when the holder's
descriptor closes, however the process ends (a SIGKILLed service never blocks its restart). The
holder's pid is written into the file only to name it in the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from rolloutlog.errors import BackendUnavailable, DataDirLocked

__all__ = ["LOCK_FILE", "DataDirLock"]

LOCK_FILE = "lock"


class DataDirLock:
    """An exclusive hold on a data directory; ``release`` (or process death) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Lock ``data_dir`` (creating it), or raise ``DataDirLocked`` without waiting."""
        path = Path(data_dir) / LOCK_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BackendUnavailable(
                f"cannot open the lock file {path}: {e}", path=str(path)
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            holder = _holder(fd)
            os.close(fd)
            by = f" by process {holder}" if holder else ""
            raise DataDirLocked(
                f"data directory {path.parent} is in use{by} (lock file {path}); "
                "stop that service first, or give this one another --data-dir",
                data_dir=str(path.parent),
                pid=holder,
            ) from e
        except OSError as e:
            os.close(fd)
            raise BackendUnavailable(f"cannot lock {path}: {e}", path=str(path)) from e
        with contextlib.suppress(OSError):  # the pid is only for the message above
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def _holder(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None
