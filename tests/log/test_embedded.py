"""Cases of the embedded backend alone (the shared contract is in tests/contract/test_log.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rolloutlog.errors import InvalidRequest
from rolloutlog.log import open_log
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


def test_acknowledged_appends_survive_sigkill(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.log._append_forever", str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert proc.stdout is not None
    acknowledged: set[int] = set()
    try:
        while len(acknowledged) < 300:
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
