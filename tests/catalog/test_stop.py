"""``Catalog.stop`` under calls in flight: new calls fail at once, the transactions already open
end on their connections, and no connection is left to be collected unclosed."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
from sqlalchemy import text

from rolloutlog.catalog import open_catalog
from rolloutlog.errors import CatalogError


async def test_a_stop_lets_the_open_transactions_end_on_their_connections(tmp_path: Path) -> None:
    catalog = open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'catalog.sqlite3'}")
    await catalog.start()
    await catalog.create_run("run")
    inside = asyncio.Event()
    release = asyncio.Event()

    async def slow_read() -> int:
        async with catalog._read() as conn:
            inside.set()
            await release.wait()
            return int((await conn.execute(text("SELECT 1"))).scalar_one())

    reading = asyncio.create_task(slow_read())
    await inside.wait()
    stopping = asyncio.create_task(catalog.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits for the read's transaction
    with pytest.raises(CatalogError, match="not started"):
        await catalog.get_run("run")
    release.set()
    assert await reading == 1
    await stopping
    gc.collect()  # an unclosed aiosqlite connection would warn here (an error under pytest)
    await catalog.start()  # and it starts again
    assert (await catalog.get_run("run")).run == "run"
    await catalog.stop()
