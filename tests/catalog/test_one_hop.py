"""An embedded catalog runs a checkpoint's two write transactions (begin, commit) whole on one
worker thread (``SQLiteBackend.write_in_one_hop``): one trip through the event loop each, not
one per statement, so a busy loop (S4's saturating appends) delays them once."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import Catalog, ManifestEntry, PartitionOffset, open_catalog
from rolloutlog.catalog._schema import checkpoints
from rolloutlog.catalog._sqlite import SQLiteBackend
from rolloutlog.errors import CatalogError, CheckpointInProgress


@pytest.fixture
async def catalog(tmp_path: Path) -> Any:
    async with open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}") as catalog:
        await catalog.create_run("r", partitions=2)
        yield catalog


def _statement_threads(catalog: Catalog) -> list[str]:
    """Names of the threads that run each statement of a one-hop write from now on."""
    backend = catalog._backend
    assert isinstance(backend, SQLiteBackend)
    threads: list[str] = []
    original = backend.write_in_one_hop

    async def recorded(fn: Any) -> Any:
        async def body(conn: AsyncConnection) -> Any:
            threads.append(threading.current_thread().name)
            return await fn(conn)

        return await original(body)

    backend.write_in_one_hop = recorded  # type: ignore[method-assign]
    return threads


async def test_a_checkpoint_begins_and_commits_on_the_catalog_thread(catalog: Catalog) -> None:
    threads = _statement_threads(catalog)
    epoch = await catalog.take_over_controller("r")
    checkpoint_id = await catalog.begin_checkpoint("r", epoch)
    with pytest.raises(CheckpointInProgress):  # driver errors are translated as before
        await catalog.begin_checkpoint("r", epoch)
    entry = ManifestEntry("e1", 0, "continue", 0, 3)
    offsets = [PartitionOffset(0, 5, 3), PartitionOffset(1, 2, 2)]
    committed = await catalog.commit_checkpoint("r", checkpoint_id, epoch, offsets, [entry])
    assert committed.status == "committed" and committed.continue_count == 1
    assert await catalog.load_manifest("r", checkpoint_id) == [entry]
    # The begin, the refused begin and the commit, each run whole on the catalog's thread.
    assert len(threads) == 3
    assert all(name.startswith("rolloutlog-catalog") for name in threads)


async def test_a_one_hop_write_that_awaits_anything_else_is_refused(catalog: Catalog) -> None:
    async def sleeps(conn: AsyncConnection) -> None:
        await conn.execute(text("SELECT 1"))
        await asyncio.sleep(0)

    with pytest.raises(CatalogError, match="awaited something else"):
        await catalog._urgent_write(sleeps)


async def test_a_cancelled_one_hop_write_keeps_the_turn_until_its_transaction_ends(
    catalog: Catalog,
) -> None:
    backend = catalog._backend
    assert isinstance(backend, SQLiteBackend)
    epoch = await catalog.take_over_controller("r")
    started, release = threading.Event(), threading.Event()

    async def slow_begin(conn: AsyncConnection) -> None:
        await conn.execute(text("UPDATE runs SET last_checkpoint_id = last_checkpoint_id"))
        started.set()
        release.wait(5)

    writing = asyncio.create_task(catalog._urgent_write(slow_begin))
    await asyncio.to_thread(started.wait, 5)
    writing.cancel()
    after = asyncio.create_task(catalog.begin_checkpoint("r", epoch))
    await asyncio.sleep(0.05)
    assert not writing.done() and not after.done()  # the thread's transaction holds the turn
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await writing
    checkpoint_id = await after
    async with catalog._engine.connect() as conn:  # type: ignore[union-attr]
        status = await conn.scalar(
            select(checkpoints.c.status).where(checkpoints.c.checkpoint_id == checkpoint_id)
        )
    assert status == "pending"


def test_the_catalog_thread_closes_with_the_catalog(tmp_path: Path) -> None:
    async def main() -> None:
        async with open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}") as catalog:
            await catalog.create_run("r")
            await catalog.begin_checkpoint("r", await catalog.take_over_controller("r"))

    asyncio.run(main())
    assert not any(t.name.startswith("rolloutlog-catalog") for t in threading.enumerate())
