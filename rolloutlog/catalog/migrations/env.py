"""Alembic environment of the catalog.

The service migrates programmatically (``rolloutlog.catalog._migrate``) and hands its open
connection in ``config.attributes["connection"]``. For developers, ``alembic -x url=... upgrade
head`` or ``revision --autogenerate`` with ``script_location`` pointing here works as well.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._schema import VERSION_TABLE, metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_url(url: str) -> None:
    engine = backend_for(url).create_engine()
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


def _main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit(
            "give the catalog URL: alembic -x url=sqlite+aiosqlite:///... upgrade head"
        )
    asyncio.run(_run_with_url(url))


_main()
