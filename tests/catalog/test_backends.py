"""Backend-specific catalog cases: URL handling, error translation, the public surface."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from rolloutlog.catalog import (
    ManifestEntry,
    PartitionOffset,
    RestoreEntry,
    open_catalog,
)
from rolloutlog.catalog._postgres import PostgresBackend
from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._validate import check_episode
from rolloutlog.errors import (
    BackendUnavailable,
    CatalogError,
    CheckpointInProgress,
    ConfigurationError,
    InvalidRequest,
)
from rolloutlog.log import capture_key


def test_capture_keys() -> None:
    assert capture_key("r17", 0) == "r17"
    assert capture_key("r17", 2) == "r17-a2"
    assert ManifestEntry("r17", 3, "continue", 0, 1).capture_key == "r17-a3"


@pytest.mark.parametrize(
    "url", ["mysql+aiomysql://x/y", "sqlite:///plain-sync.db", "postgresql+psycopg2://sync/driver"]
)
def test_unsupported_urls_are_refused(url: str) -> None:
    with pytest.raises(CatalogError, match="unsupported catalog URL"):
        open_catalog(url)


@pytest.mark.parametrize("url", ["sqlite+aiosqlite://", "sqlite+aiosqlite:///:memory:"])
async def test_in_memory_sqlite_is_refused(url: str) -> None:
    catalog = open_catalog(url)
    with pytest.raises(CatalogError, match="in-memory"):
        await catalog.start()


def test_keep_committed_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", keep_committed=0)


async def test_sqlite_creates_the_data_directory(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "catalog.db"
    async with open_catalog(f"sqlite+aiosqlite:///{path}") as catalog:
        await catalog.create_run("r")
        assert catalog.backend == "sqlite"
    assert path.exists()


async def test_sqlite_a_directory_in_place_of_the_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "catalog.db").mkdir()
    with pytest.raises(BackendUnavailable) as raised:
        await open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}").start()
    assert raised.value.retriable
    assert raised.value.__cause__ is not None
    # aiosqlite stops the worker thread of a failed connect without waiting for it; let it
    # finish before this test's event loop closes under it.
    await asyncio.sleep(0.2)


async def test_sqlite_a_file_that_is_not_a_database_is_a_catalog_error(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(CatalogError) as raised:
        await open_catalog(f"sqlite+aiosqlite:///{path}").start()
    assert raised.value.__cause__ is not None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_postgres_unreachable_is_unavailable() -> None:
    catalog = open_catalog(f"postgresql+asyncpg://postgres@127.0.0.1:{_closed_port()}/test")
    with pytest.raises(BackendUnavailable) as raised:
        await catalog.start()
    assert raised.value.code == "unavailable" and raised.value.http_status == 503
    assert raised.value.__cause__ is not None


@pytest.mark.postgres
async def test_postgres_server_settings_travel_in_the_url(postgres_schema: str) -> None:
    async with open_catalog(postgres_schema + "&statement_timeout=12345") as catalog:
        await catalog.create_run("r")
    engine = PostgresBackend(postgres_schema + "&statement_timeout=12345").create_engine()
    try:
        async with engine.connect() as conn:
            result = await conn.exec_driver_sql("SHOW statement_timeout")
            assert result.scalar_one() == "12345ms"
            result = await conn.exec_driver_sql("SELECT count(*) FROM runs")
            assert result.scalar_one() == 1
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_postgres_episodes_keep_room_for_a_restores_updates(postgres_schema: str) -> None:
    """Migration 0013: ``episodes`` pages are filled to 70%, so that a restore's update of every
    current attempt can stay on the page (no index entries written)."""
    async with open_catalog(postgres_schema) as catalog:
        await catalog.create_run("r")
    engine = PostgresBackend(postgres_schema).create_engine()
    try:
        async with engine.connect() as conn:
            result = await conn.exec_driver_sql(
                "SELECT reloptions FROM pg_class WHERE oid = 'episodes'::regclass"
            )
            assert result.scalar_one() == ["fillfactor=70"]
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_postgres_makes_a_restores_attempts_current_by_a_hash_join(
    postgres_schema: str,
) -> None:
    """The rows a restore's commit just inserted have no statistics: PostgreSQL estimated one
    row each side and sometimes scanned the restore's rows once per episode (103 ms for S2's
    1,000, quadratic). ``join_by_hash`` turns nested loops off for those statements only, and a
    restore of 600 episodes then plans its updates without one and commits them all."""
    from rolloutlog.catalog._restore_commit import _NEW_STATUS, _SAME_STATUS

    names = [f"e{i}" for i in range(600)]
    async with open_catalog(postgres_schema) as catalog:
        await catalog.create_run("r", partitions=1)
        epoch = await catalog.take_over_controller("r")
        checkpoint_id = await catalog.begin_checkpoint("r", epoch)
        manifest = [ManifestEntry(name, 0, "continue", 0, 1) for name in names]
        await catalog.commit_checkpoint(
            "r", checkpoint_id, epoch, [PartitionOffset(0, 1)], manifest
        )
        for attempt in (1, 2):  # the first inserts the episodes' rows, the second updates them
            plan = [RestoreEntry(name, attempt - 1, attempt, "continue") for name in names]
            await catalog.commit_restore("r", epoch, checkpoint_id, plan)
        current = {e.current_attempt for e in await catalog.list_episodes("r", limit=1000)}
        assert current == {2}
    backend = PostgresBackend(postgres_schema)
    engine = backend.create_engine()
    keys = {"run": "r", "restore_id": 2, "now": 0.0}
    try:
        async with engine.begin() as conn:
            await backend.join_by_hash(conn, True)
            assert (await conn.exec_driver_sql("SHOW enable_nestloop")).scalar_one() == "off"
            for statement in (_SAME_STATUS, _NEW_STATUS):
                plan = "\n".join(
                    r[0] for r in await conn.execute(text(f"EXPLAIN {statement.text}"), keys)
                )
                assert "Nested Loop" not in plan, plan
            await backend.join_by_hash(conn, False)
            assert (await conn.exec_driver_sql("SHOW enable_nestloop")).scalar_one() == "on"
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_postgres_timeouts_travel_in_the_url(postgres_schema: str) -> None:
    """A statement past ``command_timeout`` is cut off client-side and is ``unavailable``; the
    timeout parameters are the catalog's own, never sent as server settings."""
    url = postgres_schema + "&command_timeout=0.3&pool_timeout=4&connect_timeout=5"
    backend = PostgresBackend(url)
    assert backend.timeouts_s == {"connect_timeout": 5, "command_timeout": 0.3, "pool_timeout": 4}
    engine = backend.create_engine()
    try:
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("SELECT 1")).scalar_one() == 1
        started = asyncio.get_running_loop().time()
        with pytest.raises(Exception) as raised:
            async with engine.connect() as conn:
                await conn.exec_driver_sql("SELECT pg_sleep(5)")
        assert asyncio.get_running_loop().time() - started < 3
        translated = backend.translate(raised.value)
        assert isinstance(translated, BackendUnavailable), translated
        assert "command_timeout=0.3" in translated.message, translated.message
    finally:
        await engine.dispose()


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_postgres_timeouts_must_be_positive_seconds(value: str) -> None:
    with pytest.raises(ConfigurationError, match="command_timeout"):
        PostgresBackend(f"postgresql+asyncpg://u@h/db?command_timeout={value}")


async def _terminate_backends(url: str, name: str) -> None:
    """Kill every server backend of the catalog named ``name`` (as a server restart would) and
    wait until they are gone."""
    admin = backend_for(url).create_engine()
    try:
        async with admin.connect() as conn:
            await conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name"
                ),
                {"name": name},
            )
            left = 1
            while left:
                await asyncio.sleep(0.02)
                result = await conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"),
                    {"name": name},
                )
                left = result.scalar_one()
                await conn.commit()  # pg_stat_activity holds still within a transaction
    finally:
        await admin.dispose()


@pytest.mark.postgres
async def test_postgres_lost_connection_is_unavailable(postgres_schema: str) -> None:
    # A name of its own, so that only this catalog's server backends get killed.
    name = f"rolloutlog-test-{uuid.uuid4().hex[:8]}"
    async with open_catalog(f"{postgres_schema}&application_name={name}") as catalog:
        await catalog.create_run("r")
        # Pooled connections the server closed are replaced before use: no failed call.
        await _terminate_backends(postgres_schema, name)
        await asyncio.sleep(0.05)  # the event loop sees the hang-ups
        assert (await catalog.get_run("r")).run == "r"

        # A connection lost in the middle of a statement is unavailable (retriable).
        async def sleep_in_the_catalog() -> None:
            async with catalog._write() as conn:
                await conn.execute(text("SELECT pg_sleep(30)"))

        sleeping = asyncio.create_task(sleep_in_the_catalog())
        await asyncio.sleep(0.2)
        await _terminate_backends(postgres_schema, name)
        with pytest.raises(BackendUnavailable):
            await sleeping
        # The pool recovers on the next call.
        assert (await catalog.get_run("r")).run == "r"


def _storable(episode: str) -> bool:
    """Any text, except what the catalog refuses: a name with ``-a`` must be a valid episode id
    (``check_episode``: it must not look like a capture key)."""
    if "-a" not in episode:
        return True
    try:
        check_episode(episode)
    except InvalidRequest:
        return False
    return True


_episode_ids = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=40
).filter(_storable)
_entries = st.lists(
    st.builds(
        ManifestEntry,
        episode=_episode_ids,
        attempt=st.integers(0, 2**31 - 1),
        action=st.sampled_from(["continue", "restart", "finished"]),
        cut_partition=st.integers(0, 3),
        cut_offset=st.integers(0, 2**62),
        last_stage=st.none() | st.text(max_size=20),
        staging_keys=st.lists(st.text(max_size=12), max_size=3).map(tuple),
        size_bytes=st.integers(0, 2**40),
    ),
    max_size=30,
    unique_by=lambda entry: entry.episode,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=_entries)
def test_any_manifest_reads_back_exactly(tmp_path: Path, entries: list[ManifestEntry]) -> None:
    async def roundtrip() -> list[ManifestEntry]:
        async with open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'prop.db'}") as catalog:
            await catalog.create_run("prop", partitions=4)
            epoch = await catalog.take_over_controller("prop")
            checkpoint_id = await catalog.begin_checkpoint("prop", epoch)
            offsets = [PartitionOffset(p, 10) for p in range(4)]
            await catalog.commit_checkpoint("prop", checkpoint_id, epoch, offsets, entries)
            return await catalog.load_manifest("prop", checkpoint_id)

    # SQLite orders text by bytes, as UTF-8 encoding does.
    expected = sorted(entries, key=lambda entry: entry.episode.encode())
    assert asyncio.run(roundtrip()) == expected


def test_integrity_conflicts_translate_by_constraint() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(
            "CREATE TABLE checkpoints (run TEXT, checkpoint_id INT, status TEXT, PRIMARY KEY (run, checkpoint_id))"
        )
        conn.execute(
            "CREATE UNIQUE INDEX uq_checkpoints_one_pending ON checkpoints (run) "
            "WHERE status = 'pending'"
        )
        conn.execute("INSERT INTO checkpoints VALUES ('a', 1, 'pending')")
        errors = []
        for row in (("a", 2, "pending"), ("a", 1, "committed")):
            with pytest.raises(sqlite3.IntegrityError) as raised:
                conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?)", row)
            errors.append(raised.value)
    finally:
        conn.close()
    backend = backend_for("sqlite+aiosqlite:///unused.db")
    second_pending, duplicate_id = (backend.translate(error) for error in errors)
    assert isinstance(second_pending, CheckpointInProgress)
    assert type(duplicate_id) is CatalogError


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"episode": "r1-a2"}, "invalid episode id"),
        ({"episode": "has space"}, "invalid episode id"),
        ({"episode": "a" * 200 + "\n"}, "episode must be a string"),
        ({"episode": "r0"}, "appears twice"),
        ({"action": "finished"}, "restore action"),
        ({"previous_attempt": -1}, "previous_attempt"),
        ({"attempt": 0}, "attempt must be"),
        ({"attempt": True}, "attempt must be"),
    ],
)
async def test_a_restore_plan_is_checked_entry_by_entry(
    tmp_path: Path, change: dict[str, object], words: str
) -> None:
    """The whole-column check lets nothing through that the entry-by-entry check refuses, and
    the error still names the entry."""
    catalog = open_catalog(f"sqlite+aiosqlite:///{tmp_path}/c.sqlite3")
    async with catalog:
        plan = [RestoreEntry(f"r{i}", 0, 1, "continue") for i in range(50)]
        plan[7] = plan[7]._replace(**change)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match=words):
            await catalog.commit_restore("run", 1, 1, plan)
