"""The service's hold on glibc's allocator (nothing elsewhere: another libc has neither call).

- ``limit_arenas``: glibc gives each thread that meets a locked arena a new one (up to 8 per
  core), and an arena keeps the pages it freed; the service's threads (the log's writer and
  readers, the catalog's, uvicorn's) each left tens of MB of freed pages in their own arenas.
  Measured on S1 (embedded, restore + fetch, two alternating pairs of
  ``suite.py --workloads S1 --parts main --runs 2``): peak RSS 381/379 MB with glibc's default,
  354/359 MB with 2 arenas, restore + fetch 1.89 s against 1.91 s.
- ``fix_mmap_threshold``: glibc serves a block of at least its mmap threshold (128 KB at start)
  from pages of its own, handed back when it is freed, but raises the threshold to the size of
  each such block freed (up to 32 MB), so that later blocks of that size come from the heap,
  where freed pages stay. A Kafka read's Fetch answers (pages of up to 4 MB, 16 partitions at
  once) then left the heap larger after every restore. Measured (S1 on Kafka + PostgreSQL, 4
  restores + fetches, ``benchmarks/restore_fetch.py``, one run with glibc's default then one with
  the threshold fixed at 1 MB, machine shared): the service's RSS after each fetch 381, 381, 406,
  431 MB against 339, 330, 338, 342 MB; peak 445 against 409 MB; the service's CPU per restore +
  fetch 2.88 against 2.93 s. Blocks below it (a 350 KB session state) still come from the heap.
- ``trim``: hand freed heap pages back to the OS (``malloc_trim``); a restore calls it before
  it builds its projection lines.

An operator's own ``MALLOC_ARENA_MAX`` and ``MALLOC_MMAP_THRESHOLD_`` are left as set."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["SERVICE_ARENAS", "SERVICE_MMAP_THRESHOLD", "fix_mmap_threshold", "limit_arenas", "trim"]

#: The arenas ``rolloutlog serve`` allows (``limit_arenas``).
SERVICE_ARENAS = 2
#: The block size from which ``rolloutlog serve``'s allocations get pages of their own
#: (``fix_mmap_threshold``).
SERVICE_MMAP_THRESHOLD = 1024 * 1024
#: mallopt's parameter numbers for the arena limit and the mmap threshold (glibc's
#: ``M_ARENA_MAX``, ``M_MMAP_THRESHOLD``).
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3


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


def fix_mmap_threshold(threshold: int = SERVICE_MMAP_THRESHOLD) -> bool:
    """Serve every block of ``threshold`` bytes or more from pages of its own, handed back when
    it is freed, from now on (glibc then stops moving the threshold); False where it does
    nothing (not glibc, or ``MALLOC_MMAP_THRESHOLD_`` already chosen)."""
    if _LIBC is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> None:
    """Hand the heap's freed pages back to the OS (glibc's ``malloc_trim(0)``), if glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
