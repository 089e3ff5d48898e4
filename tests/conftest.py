from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from tests._services import DEFAULT_POSTGRES_URL, kafka_broker, unavailable

_SHARED_SCOPES = {"class", "module", "package"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``), keep the tests of a module whose
    fixture outlives one test (a module-scoped service, browser or PostgreSQL cluster) on one
    worker, so it starts once; every other test goes to whichever worker is free. Session
    fixtures (the Tansu broker, the PostgreSQL URL) start once per worker; tests share them
    isolated by run names, schemas, temp dirs and free ports."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        defs = (d for ds in info.name2fixturedefs.values() for d in ds)
        if any(d.scope in _SHARED_SCOPES for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a real Kafka-protocol broker for this test session."""
    explicit = os.environ.get("ROLLOUTLOG_TEST_KAFKA")
    if explicit:
        yield explicit
        return
    try:
        broker = kafka_broker()
        bootstrap = broker.__enter__()
    except Exception as e:  # the reason is what matters here, whatever failed
        unavailable(f"no Kafka-protocol broker: {e}")
        return
    try:
        yield bootstrap
    finally:
        broker.__exit__(None, None, None)


async def _postgres_reachable(url: str) -> str | None:
    import asyncpg

    dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    try:
        conn = await asyncio.wait_for(asyncpg.connect(dsn), timeout=5)
    except Exception as e:  # any failure to connect means "not reachable"
        return f"{type(e).__name__}: {e}"
    await conn.close()
    return None


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """SQLAlchemy URL of a reachable PostgreSQL database (the local server by default)."""
    url = os.environ.get("ROLLOUTLOG_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    problem = asyncio.run(_postgres_reachable(url))
    if problem is not None:
        unavailable(f"no PostgreSQL at {url}: {problem}")
    return url


@pytest.fixture
async def postgres_schema(postgres_url: str) -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL schema for one test; yields a URL whose search_path points at it.

    asyncpg takes no libpq ``options=`` in a URL, so the schema travels as ``?search_path=NAME``,
    which ``rolloutlog.catalog`` passes on as a server setting (a plain SQLAlchemy engine would
    refuse it). A schema costs milliseconds where a fresh database costs half a second.
    """
    import asyncpg
    from sqlalchemy.engine import make_url

    schema = f"t_{uuid.uuid4().hex[:12]}"
    base = make_url(postgres_url)
    dsn = base.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
    finally:
        await conn.close()
    yield base.update_query_dict({"search_path": schema}).render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await conn.close()
