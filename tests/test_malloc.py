"""The service's hold on glibc's allocator (``rolloutlog._malloc``): threads that allocate share
the allowed arenas instead of getting one each (glibc's ``malloc_stats`` lists them), and large
blocks freed go back to the OS once the mmap threshold is fixed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rolloutlog import _malloc

_PROGRAM = """
import ctypes, ctypes.util, sys, threading
from rolloutlog import _malloc
if sys.argv[1] == "limit":
    assert _malloc.limit_arenas(1)
def work():
    kept = [bytearray(1000) for _ in range(2000)]
    del kept
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_stats()
"""


def _run(program: str, mode: str) -> subprocess.CompletedProcess[str]:
    """``program`` in a fresh interpreter, without the operator's own ``MALLOC_*`` choices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run(
        [sys.executable, "-c", program, mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )


def _arenas(mode: str) -> int:
    done = _run(_PROGRAM, mode)
    return sum(1 for line in done.stderr.splitlines() if line.startswith("Arena "))


@pytest.mark.skipif(_malloc._LIBC is None, reason="not glibc: the service leaves malloc alone")
def test_threads_share_the_allowed_arenas() -> None:
    assert _arenas("default") > 1  # glibc's default: a new arena per thread
    assert _arenas("limit") == 1


def test_an_operators_own_arena_limit_is_left_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert not _malloc.limit_arenas()


_MMAP_PROGRAM = """
import sys
from rolloutlog import _malloc
if sys.argv[1] == "fix":
    assert _malloc.fix_mmap_threshold()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = bytearray(8 << 20)
del big  # glibc's default moves its mmap threshold past 8 MB here
pages, pins = [], []
for _ in range(40):  # 80 MB of 2 MB pages (a Kafka read's), each with a live block after it
    pages.append(bytearray(2 << 20))
    pins.append(bytearray(100_000))
before = rss_mb()
del pages
print(before - rss_mb())
"""


def _released_mb(mode: str) -> float:
    return float(_run(_MMAP_PROGRAM, mode).stdout)


@pytest.mark.skipif(_malloc._LIBC is None, reason="not glibc: the service leaves malloc alone")
def test_large_blocks_freed_go_back_to_the_os_with_the_threshold_fixed() -> None:
    assert _released_mb("default") < 20  # glibc's default: the pages came from the heap, kept
    assert _released_mb("fix") > 60


def test_an_operators_own_mmap_threshold_is_left_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")
    assert not _malloc.fix_mmap_threshold()
