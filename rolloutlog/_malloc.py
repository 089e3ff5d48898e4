"""The service's hold on glibc's allocator (nothing elsewhere: another libc has neither call).

- ``limit_arenas``: glibc gives each thread that meets a locked arena a new one (up to 8 per
  core), and an arena keeps the pages it freed; the service's threads (the log's writer and
  readers, the catalog's, uvicorn's) each left tens of MB of freed pages in their own arenas.
  Measured on S1 (embedded, restore + fetch, two alternating pairs of
  ``suite.py --workloads S1 --parts main --runs 2``): peak RSS 381/379 MB with glibc's default,
  354/359 MB with 2 arenas, restore + fetch 1.89 s against 1.91 s.
- ``trim``: hand freed heap pages back to the OS (``malloc_trim``); a restore calls it before
  it builds its projection lines.

An operator's own ``MALLOC_ARENA_MAX`` is left as set."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["SERVICE_ARENAS", "limit_arenas", "trim"]

#: The arenas ``rolloutlog serve`` allows (``limit_arenas``).
SERVICE_ARENAS = 2
#: mallopt's parameter number for the arena limit (glibc's ``M_ARENA_MAX``).
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc's, not another libc's
        libc.mallopt  # noqa: B018
    except (AttributeError, OSError):
        return None
    return libc


_LIBC = _libc()


def limit_arenas(arenas: int = SERVICE_ARENAS) -> bool:
    """Allow at most ``arenas`` malloc arenas from now on (call it before the threads start);
    False where it does nothing (not glibc, or ``MALLOC_ARENA_MAX`` already chosen)."""
    if _LIBC is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(_LIBC.mallopt(_M_ARENA_MAX, arenas))


def trim() -> None:
    """Hand the heap's freed pages back to the OS (glibc's ``malloc_trim(0)``), if glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
