"""The catalog contract: every case runs on SQLite and on PostgreSQL (docs/design.md §5-§6)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from rolloutlog.catalog import (
    Catalog,
    EpisodeFinish,
    EpisodeStart,
    ManifestEntry,
    PartitionOffset,
    QuarantinedRecord,
    RestoreEntry,
    head_revision,
    open_catalog,
)
from rolloutlog.catalog._migrate import alembic_config
from rolloutlog.catalog._registry import backend_for
from rolloutlog.catalog._schema import VERSION_TABLE, metadata
from rolloutlog.errors import (
    CatalogVersionError,
    CheckpointInProgress,
    CheckpointNotPending,
    InvalidRequest,
    RestoreConflict,
    RunExists,
    StaleController,
    UnknownCheckpoint,
    UnknownEpisode,
    UnknownRestore,
    UnknownRun,
)
from tests.catalog._commit_and_die import kill_during_commit

P = 4
RUN = "run-1"

CatalogFactory = Callable[..., Awaitable[Catalog]]


def raw_engine(url: str) -> AsyncEngine:
    """An engine on the catalog's database that bypasses the catalog's checks."""
    return backend_for(url).create_engine()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty catalog database of one backend."""
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema"))
    return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture
async def catalog_factory(catalog_url: str) -> AsyncIterator[CatalogFactory]:
    """Opens started catalogs over the same database; stops them all at the end."""
    opened: list[Catalog] = []

    async def factory(**options: Any) -> Catalog:
        catalog = open_catalog(catalog_url, **options)
        opened.append(catalog)
        await catalog.start()
        return catalog

    try:
        yield factory
    finally:
        for catalog in opened:
            await catalog.stop()


@pytest.fixture
async def catalog(catalog_factory: CatalogFactory) -> Catalog:
    return await catalog_factory()


async def controlled_run(catalog: Catalog, run: str = RUN, partitions: int = P) -> int:
    """Create a run and take over its controller; return the controller epoch."""
    await catalog.create_run(run, partitions=partitions)
    return await catalog.take_over_controller(run)


def make_entries(count: int, *, attempt: int = 0, finished_every: int = 0) -> list[ManifestEntry]:
    entries = []
    for i in range(count):
        action = "finished" if finished_every and i % finished_every == 0 else "continue"
        if action == "continue" and i % 7 == 3:
            action = "restart"
        entries.append(
            ManifestEntry(
                episode=f"r{i:05d}",
                attempt=attempt,
                action=action,  # type: ignore[arg-type]
                cut_partition=i % P,
                cut_offset=10 + i,
                last_stage="invoke_agent" if i % 2 else None,
                staging_keys=(f"s{i}", f"s{i}b") if i % 3 == 0 else (),
                size_bytes=100 + i,
            )
        )
    return entries


def make_offsets(partitions: int = P, marker: int = 1000) -> list[PartitionOffset]:
    return [PartitionOffset(p, marker + p, p) for p in range(partitions)]


async def commit(catalog: Catalog, epoch: int, entries: list[ManifestEntry], run: str = RUN) -> int:
    checkpoint_id = await catalog.begin_checkpoint(run, epoch)
    await catalog.commit_checkpoint(run, checkpoint_id, epoch, make_offsets(), entries)
    return checkpoint_id


async def manifest_rows(url: str, checkpoint_id: int, run: str = RUN) -> int:
    """Rows of a checkpoint's manifest as stored, counted past the catalog's own checks."""
    engine = raw_engine(url)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text(
                    "SELECT count(*) FROM manifest_entries WHERE run = :run AND checkpoint_id = :c"
                ),
                {"run": run, "c": checkpoint_id},
            )
            return int(result.scalar_one())
    finally:
        await engine.dispose()


def restore_plan(entries: list[ManifestEntry], previous: int = 0) -> list[RestoreEntry]:
    return [
        RestoreEntry(
            entry.episode,
            previous,
            previous + 1,
            "continue" if entry.action == "continue" else "restart",
        )
        for entry in entries
        if entry.action != "finished"
    ]


# -- migrations and lifecycle --------------------------------------------------------------------


async def test_start_migrates_an_empty_database_and_a_rerun_is_a_noop(catalog_url: str) -> None:
    async with open_catalog(catalog_url) as first:
        assert first.migrated_from is None
        assert await first.schema_revision() == head_revision()
        await first.create_run(RUN, partitions=P)
    async with open_catalog(catalog_url) as again:
        assert again.migrated_from == head_revision()
        assert await again.schema_revision() == head_revision()
        assert (await again.get_run(RUN)).partitions == P


async def test_concurrent_starts_migrate_once(catalog_url: str) -> None:
    catalogs = [open_catalog(catalog_url) for _ in range(3)]
    try:
        await asyncio.gather(*(catalog.start() for catalog in catalogs))
        assert sum(catalog.migrated_from is None for catalog in catalogs) == 1
    finally:
        for catalog in catalogs:
            await catalog.stop()


def _schema_differences(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return list(compare_metadata(context, metadata))


async def test_migrations_create_exactly_the_schema_module(
    catalog: Catalog, catalog_url: str
) -> None:
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            assert await conn.run_sync(_schema_differences) == []
    finally:
        await engine.dispose()


def _upgrade_to(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def test_an_old_catalog_upgrades_in_place(catalog_url: str) -> None:
    engine = raw_engine(catalog_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade_to, "0001_core")
            await conn.execute(
                text(
                    "INSERT INTO runs (run, partitions, controller_epoch, created_at) "
                    "VALUES ('old-run', 3, 5, 1.5)"
                )
            )
    finally:
        await engine.dispose()
    async with open_catalog(catalog_url) as catalog:
        assert catalog.migrated_from == "0001_core"
        assert await catalog.schema_revision() == head_revision()
        run = await catalog.get_run("old-run")
        assert (run.partitions, run.controller_epoch) == (3, 5)
        checkpoint_id = await catalog.begin_checkpoint("old-run", 5)
        await catalog.commit_checkpoint(
            "old-run", checkpoint_id, 5, make_offsets(3), [ManifestEntry("r1", 0, "continue", 0, 1)]
        )
        restore = await catalog.commit_restore(
            "old-run", 5, checkpoint_id, [RestoreEntry("r1", 0, 1, "continue")]
        )
        assert restore.restore_id == 1


async def test_a_catalog_newer_than_the_code_is_refused(catalog_url: str) -> None:
    async with open_catalog(catalog_url) as catalog:
        await catalog.create_run(RUN)
    engine = raw_engine(catalog_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
    finally:
        await engine.dispose()
    newer = open_catalog(catalog_url)
    with pytest.raises(CatalogVersionError) as raised:
        await newer.start()
    assert "9999_future" in raised.value.message
    assert raised.value.details["head"] == head_revision()
    assert raised.value.code == "catalog_too_new"
    with pytest.raises(CatalogVersionError):
        async with open_catalog(catalog_url):
            pass


async def test_pending_checkpoints_are_aborted_on_start(catalog_factory: CatalogFactory) -> None:
    first = await catalog_factory()
    epoch = await controlled_run(first)
    checkpoint_id = await first.begin_checkpoint(RUN, epoch)
    await first.stop()

    keeper = await catalog_factory(abort_pending_on_start=False)
    assert (await keeper.get_checkpoint(RUN, checkpoint_id)).status == "pending"
    await keeper.stop()

    restarted = await catalog_factory()
    aborted = await restarted.get_checkpoint(RUN, checkpoint_id)
    assert aborted.status == "aborted"
    assert aborted.reason and "start" in aborted.reason
    assert aborted.ended_at is not None
    assert await restarted.begin_checkpoint(RUN, epoch) == checkpoint_id + 1


async def test_operations_need_a_started_catalog(catalog_url: str) -> None:
    catalog = open_catalog(catalog_url)
    with pytest.raises(Exception, match="not started"):
        await catalog.get_run(RUN)
    async with catalog:
        await catalog.create_run(RUN)
    with pytest.raises(Exception, match="not started"):
        await catalog.get_run(RUN)


# -- runs and participants -----------------------------------------------------------------------


async def test_create_run_is_idempotent_and_refuses_other_settings(catalog: Catalog) -> None:
    created = await catalog.create_run(RUN, partitions=8, log_url="embedded://data")
    assert (created.partitions, created.log_url, created.controller_epoch) == (
        8,
        "embedded://data",
        0,
    )
    assert await catalog.create_run(RUN, partitions=8, log_url="embedded://data") == created
    assert await catalog.create_run(RUN) == created
    with pytest.raises(RunExists) as raised:
        await catalog.create_run(RUN, partitions=4)
    assert raised.value.details["settings"]["partitions"] == {"existing": 8, "requested": 4}
    with pytest.raises(RunExists):
        await catalog.create_run(RUN, log_url="kafka://elsewhere")
    assert (await catalog.create_run("other")).partitions == 16


async def test_invalid_run_settings_are_refused(catalog: Catalog) -> None:
    for name in ("", "bad/name", "x" * 201, " lead"):
        with pytest.raises(InvalidRequest):
            await catalog.create_run(name)
    with pytest.raises(InvalidRequest):
        await catalog.create_run(RUN, partitions=0)


async def test_unknown_run_raises_everywhere(catalog: Catalog) -> None:
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: catalog.get_run("nope"),
        lambda: catalog.register_participant("nope", "env-0", "environment"),
        lambda: catalog.take_over_controller("nope"),
        lambda: catalog.begin_checkpoint("nope", 1),
        lambda: catalog.latest_checkpoint("nope"),
        lambda: catalog.list_checkpoints("nope"),
        lambda: catalog.get_checkpoint("nope", 1),
        lambda: catalog.list_episodes("nope"),
        lambda: catalog.current_attempts("nope"),
        lambda: catalog.run_stats("nope"),
        lambda: catalog.run_summary("nope"),
        lambda: catalog.commit_restore("nope", 1, 1, []),
        lambda: catalog.get_restore("nope", 1),
    ]
    for call in calls:
        with pytest.raises(UnknownRun):
            await call()


async def test_registration_returns_the_next_epoch_per_participant(catalog: Catalog) -> None:
    await catalog.create_run(RUN)
    assert await catalog.register_participant(RUN, "env-0", "environment") == 1
    assert await catalog.register_participant(RUN, "env-0", "environment") == 2
    assert await catalog.register_participant(RUN, "policy-0", "policy") == 1
    await catalog.create_run("other")
    assert await catalog.register_participant("other", "env-0", "environment") == 1
    with pytest.raises(InvalidRequest) as raised:
        await catalog.register_participant(RUN, "env-0", "agent")
    assert raised.value.details["registered_kind"] == "environment"
    with pytest.raises(InvalidRequest):
        await catalog.register_participant(RUN, "x", "trainer")
    assert await catalog.register_participant(RUN, "env-0", "environment") == 3
    listed = {p.participant_id: (p.kind, p.epoch) for p in await catalog.list_participants(RUN)}
    assert listed == {"env-0": ("environment", 3), "policy-0": ("policy", 1)}


async def test_concurrent_registrations_never_share_an_epoch(
    catalog_factory: CatalogFactory,
) -> None:
    first, second = await catalog_factory(), await catalog_factory()
    await first.create_run(RUN)
    epochs = await asyncio.gather(
        *(
            (first if i % 2 else second).register_participant(RUN, "env-0", "environment")
            for i in range(24)
        )
    )
    assert sorted(epochs) == list(range(1, 25))


async def test_touch_participants_moves_last_seen_forward_only(catalog: Catalog) -> None:
    await catalog.create_run(RUN)
    await catalog.register_participant(RUN, "env-0", "environment")
    registered = (await catalog.list_participants(RUN))[0].last_seen_at
    await catalog.touch_participants(RUN, {"env-0": registered + 50, "ghost": 1.0})
    await catalog.touch_participants(RUN, {"env-0": registered + 10})
    assert (await catalog.list_participants(RUN))[0].last_seen_at == registered + 50


# -- controller fencing --------------------------------------------------------------------------


async def test_takeover_increments_and_compares_and_sets(catalog: Catalog) -> None:
    await catalog.create_run(RUN)
    assert await catalog.take_over_controller(RUN) == 1
    assert await catalog.take_over_controller(RUN, expected_epoch=1) == 2
    with pytest.raises(StaleController) as raised:
        await catalog.take_over_controller(RUN, expected_epoch=1)
    assert raised.value.details["current_epoch"] == 2
    assert (await catalog.get_run(RUN)).controller_epoch == 2


async def test_two_concurrent_takeovers_exactly_one_wins(catalog_factory: CatalogFactory) -> None:
    first, second = await catalog_factory(), await catalog_factory()
    await first.create_run(RUN)
    for expected in range(8):
        outcomes = await asyncio.gather(
            first.take_over_controller(RUN, expected_epoch=expected),
            second.take_over_controller(RUN, expected_epoch=expected),
            return_exceptions=True,
        )
        winners = [o for o in outcomes if isinstance(o, int)]
        losers = [o for o in outcomes if isinstance(o, StaleController)]
        assert winners == [expected + 1], outcomes
        assert len(losers) == 1, outcomes
    assert (await first.get_run(RUN)).controller_epoch == 8


async def test_unconditional_concurrent_takeovers_get_distinct_epochs(
    catalog_factory: CatalogFactory,
) -> None:
    first, second = await catalog_factory(), await catalog_factory()
    await first.create_run(RUN)
    epochs = await asyncio.gather(
        *((first if i % 2 else second).take_over_controller(RUN) for i in range(10))
    )
    assert sorted(epochs) == list(range(1, 11))


async def test_stale_controller_is_refused_by_every_checkpoint_and_restore_step(
    catalog: Catalog,
) -> None:
    epoch = await controlled_run(catalog)
    committed = await commit(catalog, epoch, make_entries(5))
    pending = await catalog.begin_checkpoint(RUN, epoch)
    new_epoch = await catalog.take_over_controller(RUN)
    assert new_epoch == epoch + 1
    # The takeover aborted the old controller's pending checkpoint.
    assert (await catalog.get_checkpoint(RUN, pending)).status == "aborted"
    stale_calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: catalog.begin_checkpoint(RUN, epoch),
        lambda: catalog.commit_checkpoint(RUN, pending, epoch, make_offsets(), []),
        lambda: catalog.abort_checkpoint(RUN, pending, epoch, "stale"),
        lambda: catalog.commit_restore(RUN, epoch, committed, []),
        lambda: catalog.begin_checkpoint(RUN, 0),
    ]
    for call in stale_calls:
        with pytest.raises(StaleController) as raised:
            await call()
        assert raised.value.code == "stale_controller"
        assert raised.value.details["current_epoch"] == new_epoch
    assert await catalog.begin_checkpoint(RUN, new_epoch) == pending + 1


async def test_no_checkpoint_before_a_controller_takes_over(catalog: Catalog) -> None:
    await catalog.create_run(RUN)
    with pytest.raises(StaleController):
        await catalog.begin_checkpoint(RUN, 0)


async def test_invalid_checkpoint_requests_are_refused(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    for options in ({"trigger": ""}, {"trigger": "x" * 65}, {"deadline_s": 0}, {"deadline_s": -1}):
        with pytest.raises(InvalidRequest):
            await catalog.begin_checkpoint(RUN, epoch, **options)  # type: ignore[arg-type]
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch, trigger="sigterm", deadline_s=0.5)
    beyond = [*make_offsets()[1:], PartitionOffset(P, 1)]  # no partition 0, a partition P
    negative = [PartitionOffset(0, -1), *make_offsets()[1:]]
    for offsets in (beyond, negative):
        with pytest.raises(InvalidRequest):
            await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, offsets, [])
    assert (await catalog.get_checkpoint(RUN, checkpoint_id)).status == "pending"


# -- checkpoints ---------------------------------------------------------------------------------


async def test_one_pending_checkpoint_per_run_and_ids_increase(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    await catalog.create_run("other")
    other_epoch = await catalog.take_over_controller("other")
    first = await catalog.begin_checkpoint(RUN, epoch, trigger="timer", deadline_s=5)
    with pytest.raises(CheckpointInProgress) as raised:
        await catalog.begin_checkpoint(RUN, epoch)
    assert raised.value.details["checkpoint_id"] == first
    assert raised.value.retriable
    assert await catalog.begin_checkpoint("other", other_epoch) == 1
    await catalog.abort_checkpoint(RUN, first, epoch, "deadline passed")
    second = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(RUN, second, epoch, make_offsets(), make_entries(3))
    third = await catalog.begin_checkpoint(RUN, epoch)
    assert first < second < third
    pending = await catalog.get_checkpoint(RUN, first)
    assert (pending.status, pending.trigger, pending.deadline_s) == ("aborted", "timer", 5)
    assert pending.reason == "deadline passed"


async def test_concurrent_begins_exactly_one_pending(catalog_factory: CatalogFactory) -> None:
    first, second = await catalog_factory(), await catalog_factory()
    epoch = await controlled_run(first)
    outcomes = await asyncio.gather(
        first.begin_checkpoint(RUN, epoch),
        second.begin_checkpoint(RUN, epoch),
        first.begin_checkpoint(RUN, epoch),
        return_exceptions=True,
    )
    assert len([o for o in outcomes if isinstance(o, int)]) == 1, outcomes
    assert len([o for o in outcomes if isinstance(o, CheckpointInProgress)]) == 2, outcomes


async def test_commit_writes_offsets_manifest_counts_and_latest(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(50, finished_every=10)
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    pending = await catalog.get_checkpoint(RUN, checkpoint_id)
    assert pending.status == "pending" and pending.offsets == ()
    with pytest.raises(UnknownCheckpoint):
        await catalog.latest_checkpoint(RUN)
    marked_at = 1764400000.5
    result = await catalog.commit_checkpoint(
        RUN,
        checkpoint_id,
        epoch,
        make_offsets(),
        entries,
        timings_ms={"marker": 1.5},
        marked_at=marked_at,
    )
    finished = sum(e.action == "finished" for e in entries)
    restart = sum(e.action == "restart" for e in entries)
    assert result.counts == {
        "continue": len(entries) - finished - restart,
        "restart": restart,
        "finished": finished,
    }
    stored = await catalog.latest_checkpoint(RUN)
    assert stored == result
    assert stored.status == "committed" and stored.committed_at is not None
    assert stored.marked_at == marked_at
    assert stored.entry_count == 50 and stored.size_bytes == sum(e.size_bytes for e in entries)
    assert stored.timings_ms == {"marker": 1.5}
    assert stored.offsets == tuple(make_offsets())
    assert (await catalog.get_run(RUN)).latest_checkpoint_id == checkpoint_id
    assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)
    assert await catalog.staging_keys(RUN) == {k for e in entries for k in e.staging_keys}


async def test_an_empty_manifest_commits(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    checkpoint_id = await commit(catalog, epoch, [])
    assert (await catalog.latest_checkpoint(RUN)).entry_count == 0
    assert await catalog.load_manifest(RUN, checkpoint_id) == []


@pytest.mark.parametrize(
    "problem",
    ["offsets", "duplicate", "action", "partition", "capture-key-id", "negative", "keys"],
)
async def test_an_invalid_commit_writes_nothing(catalog: Catalog, problem: str) -> None:
    epoch = await controlled_run(catalog)
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    entries = make_entries(20)
    offsets = make_offsets()
    bad = entries[5]
    if problem == "offsets":
        offsets = offsets[:-1]
    elif problem == "duplicate":
        entries.append(entries[0]._replace(attempt=1))
    elif problem == "action":
        entries[5] = bad._replace(action="excluded")
    elif problem == "partition":
        entries[5] = bad._replace(cut_partition=P)
    elif problem == "capture-key-id":
        entries[5] = bad._replace(episode="r17-a2")
    elif problem == "negative":
        entries[5] = bad._replace(cut_offset=-1)
    elif problem == "keys":
        entries[5] = bad._replace(staging_keys=(1,))
    with pytest.raises(InvalidRequest):
        await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, offsets, entries)
    assert (await catalog.get_checkpoint(RUN, checkpoint_id)).status == "pending"
    assert (await catalog.get_run(RUN)).latest_checkpoint_id is None
    await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, make_offsets(), make_entries(20))


async def test_only_a_pending_checkpoint_commits_or_aborts(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    committed = await commit(catalog, epoch, make_entries(3))
    with pytest.raises(CheckpointNotPending) as raised:
        await catalog.commit_checkpoint(RUN, committed, epoch, make_offsets(), make_entries(3))
    assert raised.value.details["status"] == "committed"
    with pytest.raises(CheckpointNotPending):
        await catalog.abort_checkpoint(RUN, committed, epoch, "too late")
    aborted = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.abort_checkpoint(RUN, aborted, epoch, "operator")
    await catalog.abort_checkpoint(RUN, aborted, epoch, "again")
    assert (await catalog.get_checkpoint(RUN, aborted)).reason == "operator"
    with pytest.raises(CheckpointNotPending):
        await catalog.commit_checkpoint(RUN, aborted, epoch, make_offsets(), [])
    with pytest.raises(UnknownCheckpoint):
        await catalog.commit_checkpoint(RUN, 99, epoch, make_offsets(), [])
    with pytest.raises(UnknownCheckpoint):
        await catalog.abort_checkpoint(RUN, 99, epoch, "none")
    with pytest.raises(UnknownCheckpoint):
        await catalog.get_checkpoint(RUN, 99)
    with pytest.raises(UnknownCheckpoint):
        await catalog.load_manifest(RUN, aborted)
    assert (await catalog.latest_checkpoint(RUN)).checkpoint_id == committed


async def test_retention_keeps_the_newest_committed_and_drops_older_manifests(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    ids = [await commit(catalog, epoch, make_entries(30 + n)) for n in range(4)]
    aborted = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.abort_checkpoint(RUN, aborted, epoch, "test")
    statuses = {c.checkpoint_id: c.status for c in await catalog.list_checkpoints(RUN)}
    assert statuses == {
        ids[0]: "expired",
        ids[1]: "expired",
        ids[2]: "committed",
        ids[3]: "committed",
        aborted: "aborted",
    }
    for old in ids[:2]:
        with pytest.raises(UnknownCheckpoint) as raised:
            await catalog.load_manifest(RUN, old)
        assert raised.value.details["status"] == "expired"
        assert await manifest_rows(catalog_url, old) == 0
        expired = await catalog.get_checkpoint(RUN, old)
        assert expired.ended_at is not None and expired.entry_count == 30 + ids.index(old)
    assert len(await catalog.load_manifest(RUN, ids[2])) == 32
    assert len(await catalog.load_manifest(RUN, ids[3])) == 33
    assert (await catalog.latest_checkpoint(RUN)).checkpoint_id == ids[3]
    committed = await catalog.list_checkpoints(RUN, status="committed")
    assert [c.checkpoint_id for c in committed] == [ids[3], ids[2]]
    page = await catalog.list_checkpoints(RUN, before=ids[3], limit=2)
    assert [c.checkpoint_id for c in page] == [ids[2], ids[1]]


async def test_retention_is_configurable(catalog_factory: CatalogFactory) -> None:
    catalog = await catalog_factory(keep_committed=3)
    epoch = await controlled_run(catalog)
    for _ in range(5):
        await commit(catalog, epoch, make_entries(5))
    counts = (await catalog.run_stats(RUN)).checkpoint_counts
    assert counts == {"committed": 3, "expired": 2}


async def test_manifest_pages_and_stream(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(95, finished_every=9)
    checkpoint_id = await commit(catalog, epoch, entries)
    pages: list[ManifestEntry] = []
    after = None
    while True:
        page = await catalog.manifest_page(RUN, checkpoint_id, after=after, limit=10)
        pages.extend(page)
        if len(page) < 10:
            break
        after = page[-1].episode
    assert pages == sorted(entries)
    streamed = [e async for e in catalog.stream_manifest(RUN, checkpoint_id, batch_size=7)]
    assert streamed == sorted(entries)
    finished = await catalog.manifest_page(RUN, checkpoint_id, action="finished")
    assert finished == sorted(e for e in entries if e.action == "finished")
    assert finished[0].capture_key == finished[0].episode


async def test_a_stream_fails_when_its_checkpoint_expires_midway(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    checkpoint_id = await commit(catalog, epoch, make_entries(40))
    stream = catalog.stream_manifest(RUN, checkpoint_id, batch_size=10)
    got = [await anext(stream) for _ in range(10)]
    assert len(got) == 10
    for _ in range(2):
        await commit(catalog, epoch, make_entries(3))
    with pytest.raises(UnknownCheckpoint):
        async for _ in stream:
            pass


# -- restores ------------------------------------------------------------------------------------


async def test_restore_ids_are_reserved_once_and_commit_only_in_order(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(10, finished_every=5)
    checkpoint_id = await commit(catalog, epoch, entries)
    with pytest.raises(StaleController):
        await catalog.reserve_restore_id(RUN, epoch + 1)
    # A restore that reserved 1 and died before committing leaves 1 unused for good.
    assert await catalog.reserve_restore_id(RUN, epoch) == 1
    assert await catalog.reserve_restore_id(RUN, epoch) == 2
    with pytest.raises(RestoreConflict) as caught:  # never reserved
        await catalog.commit_restore(RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=3)
    assert caught.value.details["restore_id"] == 3
    assert await catalog.list_restores(RUN) == []
    assert await catalog.current_attempts(RUN) == {}
    restore = await catalog.commit_restore(
        RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=2
    )
    assert restore.restore_id == 2
    # The dead reservation can no longer commit: a later restore did.
    with pytest.raises(RestoreConflict) as caught:
        await catalog.commit_restore(RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=1)
    assert caught.value.details["newest_restore_id"] == 2
    assert [r.restore_id for r in await catalog.list_restores(RUN)] == [2]
    # Without an id, a restore takes the next one in its own transaction.
    plan = restore_plan(entries, previous=1)
    assert (await catalog.commit_restore(RUN, epoch, checkpoint_id, plan)).restore_id == 3


async def test_restore_commits_plan_and_new_current_attempts(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(30, finished_every=6)
    checkpoint_id = await commit(catalog, epoch, entries)
    plan = restore_plan(entries)
    plan[0] = plan[0]._replace(action="excluded", reason="trainer has the result")
    plan[1] = plan[1]._replace(action="restart", reason="ledger digest mismatch")
    plan.append(RestoreEntry(entries[0].episode, 0, 1, "excluded"))  # a finished one, retired
    restore = await catalog.commit_restore(
        RUN, epoch, checkpoint_id, plan, timings_ms={"replay": 2.0}
    )
    assert restore.restore_id == 1 and restore.checkpoint_id == checkpoint_id
    assert restore.counts == {
        "continue": sum(e.action == "continue" for e in plan),
        "restart": sum(e.action == "restart" for e in plan),
        "excluded": 2,
    }
    # The unacknowledged results are counted by the commit; a stored restore does not keep them.
    assert restore.unacknowledged_results == 0
    assert await catalog.get_restore(RUN, 1) == dataclasses.replace(
        restore, unacknowledged_results=None
    )
    assert await catalog.restore_episodes(RUN, 1, limit=None) == sorted(plan)
    stored = {e.episode: e for e in await catalog.restore_episodes(RUN, 1, limit=None)}
    assert stored["r00001"].capture_key == "r00001-a1"
    assert stored[plan[1].episode].reason == "ledger digest mismatch"
    excluded = await catalog.restore_episodes(RUN, 1, action="excluded")
    assert {e.episode for e in excluded} == {plan[0].episode, entries[0].episode}
    attempts = await catalog.current_attempts(RUN)
    assert all(attempts[e.episode] == 1 for e in plan)
    episode = await catalog.get_episode(RUN, plan[2].episode)
    assert (episode.current_attempt, episode.status, episode.capture_key) == (
        1,
        "running",
        f"{plan[2].episode}-a1",
    )
    assert (await catalog.get_episode(RUN, plan[0].episode)).status == "excluded"

    again = await catalog.commit_restore(RUN, epoch, checkpoint_id, restore_plan(entries, 1))
    assert again.restore_id == 2
    assert [r.restore_id for r in await catalog.list_restores(RUN)] == [2, 1]
    attempts = await catalog.current_attempts(RUN)
    assert {attempts[e.episode] for e in restore_plan(entries)} == {2}
    assert attempts[entries[0].episode] == 1  # finished, retired by the first restore
    assert entries[6].episode not in attempts  # finished, never restored: attempt 0


async def test_restoring_a_checkpoint_that_is_not_committed_is_refused(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    old = await commit(catalog, epoch, make_entries(4))
    for _ in range(2):
        await commit(catalog, epoch, make_entries(4))
    aborted = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.abort_checkpoint(RUN, aborted, epoch, "test")
    pending = await catalog.begin_checkpoint(RUN, epoch)
    for checkpoint_id, status in ((old, "expired"), (aborted, "aborted"), (pending, "pending")):
        with pytest.raises(UnknownCheckpoint) as raised:
            await catalog.commit_restore(RUN, epoch, checkpoint_id, [])
        assert raised.value.details["status"] == status
    with pytest.raises(UnknownCheckpoint):
        await catalog.commit_restore(RUN, epoch, 999, [])
    assert await catalog.list_restores(RUN) == []


@pytest.mark.parametrize(
    "problem", ["missing", "unknown", "finished-continued", "restart-continued", "stale", "twice"]
)
async def test_an_invalid_restore_commits_nothing(catalog: Catalog, problem: str) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(20, finished_every=5)
    checkpoint_id = await commit(catalog, epoch, entries)
    plan = restore_plan(entries)
    expected: type[Exception] = InvalidRequest
    if problem == "missing":
        plan.pop()
    elif problem == "unknown":
        plan.append(RestoreEntry("r99999", 0, 1, "continue"))
        expected = UnknownEpisode
    elif problem == "finished-continued":
        plan.append(RestoreEntry(entries[0].episode, 0, 1, "continue"))
    elif problem == "restart-continued":
        index = next(i for i, e in enumerate(plan) if e.action == "restart")
        plan[index] = plan[index]._replace(action="continue")
    elif problem == "stale":
        plan[3] = plan[3]._replace(previous_attempt=1, attempt=2)
    elif problem == "twice":
        plan.append(plan[0])
    with pytest.raises(expected):
        await catalog.commit_restore(RUN, epoch, checkpoint_id, plan)
    assert await catalog.list_restores(RUN) == []
    assert await catalog.current_attempts(RUN) == {}
    with pytest.raises(UnknownRestore):
        await catalog.get_restore(RUN, 1)
    restore = await catalog.commit_restore(RUN, epoch, checkpoint_id, restore_plan(entries))
    assert restore.restore_id == 1


async def test_a_restore_may_restart_or_exclude_episodes_begun_after_the_markers(
    catalog: Catalog,
) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(10, finished_every=5)
    checkpoint_id = await commit(catalog, epoch, entries)
    plan = [
        *restore_plan(entries),
        RestoreEntry("late-1", 0, 1, "restart", "began after the markers"),
        RestoreEntry("late-2", 0, 1, "excluded"),
    ]
    restore = await catalog.commit_restore(RUN, epoch, checkpoint_id, plan)
    assert restore.counts["restart"] == sum(e.action == "restart" for e in plan)
    assert restore.counts["excluded"] == 1
    current = await catalog.current_attempts(RUN)
    assert (current["late-1"], current["late-2"]) == (1, 1)
    # ... and the next restore of the same checkpoint starts them from their new attempt.
    again = [
        *restore_plan(entries, previous=1),
        RestoreEntry("late-1", 0, 1, "restart"),
    ]
    with pytest.raises(InvalidRequest):  # stale: late-1 is at attempt 1
        await catalog.commit_restore(RUN, epoch, checkpoint_id, again)
    again[-1] = RestoreEntry("late-1", 1, 2, "restart")
    assert (await catalog.commit_restore(RUN, epoch, checkpoint_id, again)).restore_id == 2


async def test_a_restore_sets_each_status_and_names_the_stale_episode(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(10)
    checkpoint_id = await commit(catalog, epoch, entries)
    first = restore_plan(entries)
    first[2] = first[2]._replace(action="excluded")
    await catalog.commit_restore(RUN, epoch, checkpoint_id, first)
    # The excluded episode runs again, a running one is excluded, the others stay running.
    again = restore_plan(entries, previous=1)
    again[5] = again[5]._replace(action="excluded")
    # A stale entry after others that agree: nothing changes, and the error names it.
    stale = [*again[:-1], again[-1]._replace(previous_attempt=0)]
    with pytest.raises(InvalidRequest) as raised:
        await catalog.commit_restore(RUN, epoch, checkpoint_id, stale)
    assert raised.value.details["episode"] == again[-1].episode
    assert set((await catalog.current_attempts(RUN)).values()) == {1}
    await catalog.commit_restore(RUN, epoch, checkpoint_id, again)
    assert set((await catalog.current_attempts(RUN)).values()) == {2}
    statuses = {e.episode: e.status for e in await catalog.list_episodes(RUN)}
    assert statuses[again[2].episode] == "running"
    assert statuses[again[5].episode] == "excluded"
    assert {statuses[e.episode] for i, e in enumerate(again) if i != 5} == {"running"}


async def test_attempts_must_move_forward(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    checkpoint_id = await commit(catalog, epoch, make_entries(2))
    with pytest.raises(InvalidRequest):
        await catalog.commit_restore(
            RUN, epoch, checkpoint_id, [RestoreEntry("r00000", 0, 0, "continue")]
        )


# -- queries for analysts ------------------------------------------------------------------------


async def test_runs_with_counts_and_stats(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    await catalog.create_run("idle", partitions=2)
    await catalog.register_participant(RUN, "env-0", "environment")
    await catalog.register_participant(RUN, "policy-0", "policy")
    entries = make_entries(12, finished_every=4)
    checkpoint_id = await commit(catalog, epoch, entries)
    await catalog.commit_restore(RUN, epoch, checkpoint_id, restore_plan(entries))
    summaries = {s.run.run: s for s in await catalog.list_runs()}
    assert set(summaries) == {RUN, "idle"}
    busy = summaries[RUN]
    assert (busy.participant_count, busy.restore_count, busy.episode_count) == (2, 1, 9)
    assert busy.checkpoint_counts == {"committed": 1}
    assert summaries["idle"].checkpoint_counts == {} and summaries["idle"].episode_count == 0
    assert await catalog.run_summary(RUN) == busy
    assert [s.run.run for s in await catalog.list_runs(after=RUN)] == []
    assert [s.run.run for s in await catalog.list_runs(limit=1)] == ["idle"]
    stats = await catalog.run_stats(RUN)
    assert stats.participant_count == 2 and stats.restore_count == 1
    assert stats.episode_counts == {"running": 9}
    assert stats.latest_checkpoint_id == checkpoint_id and stats.latest_entry_count == 12
    assert stats.checkpoint_duration_ms_last is not None and stats.checkpoint_duration_ms_last >= 0
    assert stats.last_restore_at is not None
    idle = await catalog.run_stats("idle")
    assert idle.latest_checkpoint_id is None and idle.checkpoint_duration_ms_mean is None


async def test_episodes_by_status_paged_and_recorded_starts(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    await catalog.record_episodes(
        RUN, [EpisodeStart(f"r{i:05d}", i % P, 100 + i, 1000.0 + i) for i in range(10)]
    )
    await catalog.record_episodes(RUN, [EpisodeStart("r00000", 3, 999, 5.0)])
    first = await catalog.get_episode(RUN, "r00000")
    assert (first.first_partition, first.first_offset, first.started_at) == (0, 100, 1000.0)
    assert (first.status, first.current_attempt) == ("running", 0)
    await catalog.record_episodes(
        RUN,
        finished=[EpisodeFinish(f"r{i:05d}", 0, 2000.0 + i) for i in range(0, 10, 3)],
    )
    running = await catalog.list_episodes(RUN, status="running", limit=3)
    assert [e.episode for e in running] == ["r00001", "r00002", "r00004"]
    more = await catalog.list_episodes(RUN, status="running", after="r00004", limit=100)
    assert [e.episode for e in more] == ["r00005", "r00007", "r00008"]
    finished = await catalog.get_episode(RUN, "r00003")
    assert (finished.status, finished.finished_at, finished.first_offset) == (
        "finished",
        2003.0,
        103,
    )
    # A finish reported for an attempt that a restore has since fenced changes nothing.
    checkpoint_id = await commit(catalog, epoch, make_entries(10))
    plan = restore_plan(make_entries(10))
    await catalog.commit_restore(RUN, epoch, checkpoint_id, plan)
    await catalog.record_episodes(RUN, finished=[EpisodeFinish("r00001", 0, 3000.0)])
    fenced = await catalog.get_episode(RUN, "r00001")
    assert (fenced.status, fenced.current_attempt, fenced.finished_at) == ("running", 1, None)
    with pytest.raises(UnknownEpisode):
        await catalog.get_episode(RUN, "r77777")
    with pytest.raises(InvalidRequest):
        await catalog.record_episodes(RUN, [EpisodeStart("r1-a3", 0, 1, 1.0)])


# -- crash safety --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "delay"), [("inside", 0.0), ("racing", 0.0), ("racing", 0.05), ("racing", 0.3)]
)
async def test_a_commit_killed_midway_leaves_nothing_or_everything(
    catalog_url: str, mode: str, delay: float
) -> None:
    state, checkpoint_id = await kill_during_commit(catalog_url, mode, delay)
    assert checkpoint_id > 0
    async with open_catalog(catalog_url) as catalog:
        checkpoint = await catalog.get_checkpoint("crash", checkpoint_id)
        rows = await manifest_rows(catalog_url, checkpoint_id, run="crash")
        if mode == "inside":
            # Killed after every manifest row was written, before the transaction committed.
            assert state == "INSIDE"
            assert checkpoint.status == "aborted"
        if checkpoint.status == "committed":
            assert checkpoint.entry_count == rows == 20_000
            assert len(await catalog.load_manifest("crash", checkpoint_id)) == 20_000
            assert (await catalog.get_run("crash")).latest_checkpoint_id == checkpoint_id
        else:
            assert checkpoint.status == "aborted"
            assert rows == 0
            assert (await catalog.get_run("crash")).latest_checkpoint_id == checkpoint_id - 1
        # The checkpoint committed before the crash is intact either way.
        assert len(await catalog.load_manifest("crash", checkpoint_id - 1)) == 10


# -- the packed manifest and its view -------------------------------------------------------------

_VIEW_SQL = (
    "SELECT episode, attempt, action, cut_partition, cut_offset, last_stage, staging_keys, "
    "size_bytes FROM manifest_entries WHERE run = :run AND checkpoint_id = :c ORDER BY episode"
)


def _as_view_rows(entries: list[ManifestEntry]) -> list[tuple[Any, ...]]:
    return [
        (*entry[:6], orjson.dumps(list(entry.staging_keys)).decode() or None, entry.size_bytes)
        if entry.staging_keys
        else (*entry[:6], None, entry.size_bytes)
        for entry in sorted(entries)
    ]


async def _view_rows(url: str, checkpoint_id: int, run: str = RUN) -> list[tuple[Any, ...]]:
    engine = raw_engine(url)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(text(_VIEW_SQL), {"run": run, "c": checkpoint_id})
            return [tuple(row) for row in result.all()]
    finally:
        await engine.dispose()


async def test_the_manifest_entries_view_reads_what_the_catalog_returns(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(300, finished_every=5)
    checkpoint_id = await commit(catalog, epoch, entries)
    loaded = await catalog.load_manifest(RUN, checkpoint_id)
    assert loaded == sorted(entries)
    assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)
    # Pages in episode order from after a key, of one action, as the REST route reads them.
    page = await catalog.manifest_page(
        RUN, checkpoint_id, after="r00100", limit=7, action="restart"
    )
    expected = [e for e in sorted(entries) if e.episode > "r00100" and e.action == "restart"][:7]
    assert page == expected


def _downgrade_to(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, revision)


async def test_a_manifest_survives_the_migration_to_packed_rows_and_back(
    catalog_url: str,
) -> None:
    entries = make_entries(50, finished_every=4)
    async with open_catalog(catalog_url) as catalog:
        epoch = await controlled_run(catalog)
        checkpoint_id = await commit(catalog, epoch, entries)
    engine = raw_engine(catalog_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_downgrade_to, "0002_restores_episodes")
    finally:
        await engine.dispose()
    # One row per entry again, read by the same SQL.
    assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)
    async with open_catalog(catalog_url) as catalog:
        assert catalog.migrated_from == "0002_restores_episodes"
        assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)
    assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)


async def test_restart_reasons_are_kept_in_the_manifest_and_its_view(catalog_url: str) -> None:
    """Revision 0006: a restart entry's reason is stored, read back and shown by the view; a
    downgrade to the revision before drops it and an upgrade reads the old entries with no
    reason."""
    script = ScriptDirectory.from_config(alembic_config())
    before_reasons = script.get_revision("0006_manifest_reasons").down_revision
    assert isinstance(before_reasons, str)
    reason = "verify step of resources server res-0 still open at the 30 s deadline"
    entries = [
        ManifestEntry("r1", 0, "restart", 0, 5, "verify", (), 10, reason),
        ManifestEntry("r2", 0, "continue", 1, 6, "seed", (), 10),
    ]
    async with open_catalog(catalog_url) as catalog:
        epoch = await controlled_run(catalog)
        checkpoint_id = await commit(catalog, epoch, entries)
        assert await catalog.load_manifest(RUN, checkpoint_id) == entries
    sql = "SELECT episode, reason FROM manifest_entries WHERE run = :run ORDER BY episode"
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(sql), {"run": RUN})).all()
        assert [tuple(row) for row in rows] == [("r1", reason), ("r2", None)]
        async with engine.begin() as conn:
            await conn.run_sync(_downgrade_to, before_reasons)
    finally:
        await engine.dispose()
    async with open_catalog(catalog_url) as catalog:
        assert catalog.migrated_from == before_reasons
        loaded = await catalog.load_manifest(RUN, checkpoint_id)
        assert loaded == [entries[0]._replace(reason=None), entries[1]]


async def test_a_manifest_reason_must_be_text(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    bad = ManifestEntry("r1", 0, "restart", 0, 5, None, (), 0, 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="reason must be a string"):
        await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, make_offsets(), [bad])


_STAGING_KEYS_SQL = {
    "postgresql": (
        "SELECT DISTINCT k.key FROM manifest_entries m JOIN checkpoints c USING (run, checkpoint_id) "
        "CROSS JOIN LATERAL jsonb_array_elements_text(m.staging_keys::jsonb) AS k(key) "
        "WHERE m.run = :run AND c.status = 'committed'"
    ),
    "sqlite": (
        "SELECT DISTINCT k.value FROM manifest_entries m JOIN checkpoints c "
        "ON c.run = m.run AND c.checkpoint_id = m.checkpoint_id, json_each(m.staging_keys) AS k "
        "WHERE m.run = :run AND c.status = 'committed'"
    ),
}


async def test_the_documented_manifest_queries_run_on_the_view(
    catalog: Catalog, catalog_url: str
) -> None:
    """docs/catalog.md's examples over ``manifest_entries`` (a view since 0003)."""
    epoch = await controlled_run(catalog)
    entries = make_entries(40, finished_every=6)
    await commit(catalog, epoch, entries)
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            keys = await conn.execute(text(_STAGING_KEYS_SQL[engine.dialect.name]), {"run": RUN})
            assert {row[0] for row in keys} == await catalog.staging_keys(RUN)
            per_action = await conn.execute(
                text(
                    "SELECT m.cut_partition, m.action, count(*), sum(m.size_bytes) FROM runs r "
                    "JOIN manifest_entries m ON m.run = r.run "
                    "AND m.checkpoint_id = r.latest_checkpoint_id WHERE r.run = :run "
                    "GROUP BY m.cut_partition, m.action ORDER BY m.cut_partition, m.action"
                ),
                {"run": RUN},
            )
            counted = {(p, a): (int(n), int(b)) for p, a, n, b in per_action}
    finally:
        await engine.dispose()
    expected: dict[tuple[int, str], tuple[int, int]] = {}
    for entry in entries:
        n, b = expected.get((entry.cut_partition, entry.action), (0, 0))
        expected[(entry.cut_partition, entry.action)] = (n + 1, b + entry.size_bytes)
    assert counted == expected


async def test_quarantined_records_are_kept_once_and_listed_in_order(
    catalog: Catalog, catalog_url: str
) -> None:
    await controlled_run(catalog)
    first = [
        QuarantinedRecord(2, 7, "not a JSON envelope", 9, b"\xff\xfegarbage"),
        QuarantinedRecord(0, 3, "the record has no event type", 12, b'{"v": 1}'),
        QuarantinedRecord(1, 0, "a NUL\x00 in the reason", 1, b"\x00"),
        QuarantinedRecord(2, 1, "x" * 5000, 1 << 20, bytes(range(256)) * 4),
    ]
    await catalog.quarantine(RUN, first)
    # Found again by a restarted projector: the first row stays.
    await catalog.quarantine(RUN, [QuarantinedRecord(0, 3, "again", 1, b"again")])
    listed = await catalog.quarantined(RUN)
    assert [(r.partition, r.offset) for r in listed] == [(0, 3), (1, 0), (2, 1), (2, 7)]
    assert listed[1].reason == "a NUL\\x00 in the reason" and listed[1].first_bytes == b"\x00"
    del listed[1]
    assert listed[0].reason == "the record has no event type" and listed[0].size == 12
    assert listed[0].first_bytes == b'{"v": 1}' and listed[0].recorded_at > 0
    assert listed[1].first_bytes == bytes(range(256)) and len(listed[1].reason) == 2000
    assert listed[2].first_bytes == b"\xff\xfegarbage"
    page = await catalog.quarantined(RUN, after=(0, 3), limit=1)
    assert [(r.partition, r.offset) for r in page] == [(1, 0)]
    assert await catalog.quarantined(RUN, after=(2, 7)) == []
    with pytest.raises(UnknownRun):
        await catalog.quarantined("no-such-run")
    # Analysts read the table with SQL too (docs/catalog.md).
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    'SELECT partition, "offset", reason FROM quarantined_records '
                    'WHERE run = :run ORDER BY partition, "offset"'
                ),
                {"run": RUN},
            )
            assert [(p, o) for p, o, _ in rows] == [(0, 3), (1, 0), (2, 1), (2, 7)]
    finally:
        await engine.dispose()


# -- finished results and their acknowledgement ---------------------------------------


def finish(episode: str, partition: int, offset: int, reward: float | None = 1.0, **kw: Any) -> Any:
    """A finish as the projector reports it: position, reward and the result's raw JSON."""
    result = kw.pop("result", orjson.dumps({"answer": episode, "n": offset}))
    return EpisodeFinish(
        episode, kw.pop("attempt", 0), 50.0 + offset, partition, offset, reward, result
    )


async def test_results_are_kept_filtered_and_acknowledged_once(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    names = [f"r{i:05d}" for i in range(5)]
    await catalog.record_episodes(
        RUN,
        [EpisodeStart(name, i % P, i, 1.0) for i, name in enumerate(names)],
        [
            finish("r00000", 0, 5, 0.5),
            finish("r00001", 1, 1500, 1.0),
            finish("r00002", 2, 1502, None, result=None),
            EpisodeFinish("r00003", 0, 9.0),  # no position: an episodes-table finish only
        ],
    )
    kept = await catalog.results_page(RUN)
    assert [(r.episode, r.partition, r.finished_offset, r.reward) for r in kept] == [
        ("r00000", 0, 5, 0.5),
        ("r00001", 1, 1500, 1.0),
        ("r00002", 2, 1502, None),
    ]
    assert orjson.loads(kept[0].result or b"") == {"answer": "r00000", "n": 5}
    assert kept[2].result is None and kept[0].capture_key == "r00000" and kept[0].ts == 55.0
    assert all(r.acknowledged_at is None for r in kept)
    assert await catalog.acknowledge_results(RUN, ["r00000", "r00009"]) == (1, ["r00009"])
    assert await catalog.acknowledge_results(RUN, ["r00000", "r00000"]) == (0, [])  # idempotent
    # The same finish folded again (a restarted projector) keeps the acknowledgement.
    await catalog.record_episodes(RUN, finished=[finish("r00000", 0, 5, 0.5)])
    unacknowledged = await catalog.results_page(RUN, unacknowledged=True)
    assert [r.episode for r in unacknowledged] == ["r00001", "r00002"]
    chosen = await catalog.results_page(RUN, episodes=["r00002", "r00000", "r00004"])
    assert [(r.episode, r.acknowledged_at is not None) for r in chosen] == [
        ("r00000", True),
        ("r00002", False),
    ]
    page = await catalog.results_page(RUN, after="r00000", limit=1)
    assert [r.episode for r in page] == ["r00001"]
    # since_checkpoint: finished at or past the checkpoint's marker of their partition (1000 + p).
    checkpoint_id = await commit(catalog, epoch, [])
    since = await catalog.results_page(RUN, since_checkpoint=checkpoint_id)
    assert [r.episode for r in since] == ["r00001", "r00002"]
    since = await catalog.results_page(RUN, since_checkpoint=checkpoint_id, unacknowledged=True)
    assert [r.episode for r in since] == ["r00001", "r00002"]
    pending = await catalog.begin_checkpoint(RUN, epoch)
    for missing in (pending, 99):
        with pytest.raises(UnknownCheckpoint):
            await catalog.results_page(RUN, since_checkpoint=missing)
    with pytest.raises(UnknownRun):
        await catalog.results_page("no-such-run")
    with pytest.raises(UnknownRun):
        await catalog.acknowledge_results("no-such-run", ["r00000"])
    with pytest.raises(InvalidRequest):
        await catalog.acknowledge_results(RUN, ["r1-a3"])


async def test_a_restore_drops_abandoned_results_keeps_excluded_ones_and_counts(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(4)  # r00000..r00002 continue, r00003 restart
    checkpoint_id = await commit(catalog, epoch, entries)
    await catalog.record_episodes(
        RUN, finished=[finish(e.episode, e.cut_partition, 2000 + i) for i, e in enumerate(entries)]
    )
    assert await catalog.acknowledge_results(RUN, ["r00002"]) == (1, [])
    plan = [
        RestoreEntry("r00000", 0, 1, "continue"),
        RestoreEntry("r00001", 0, 1, "excluded"),
        RestoreEntry("r00002", 0, 1, "excluded"),
        RestoreEntry("r00003", 0, 1, "restart"),
    ]
    restore = await catalog.commit_restore(RUN, epoch, checkpoint_id, plan)
    # r00000 and r00003 run again: their old results belonged to the abandoned timeline.
    assert [r.episode for r in await catalog.results_page(RUN)] == ["r00001", "r00002"]
    assert restore.unacknowledged_results == 1
    assert (await catalog.get_restore(RUN, restore.restore_id)).unacknowledged_results is None
    assert await catalog.result_episodes(RUN) == {"r00001", "r00002"}
    # A late copy of an abandoned attempt's finish is never recorded; an excluded one's stays.
    await catalog.record_episodes(
        RUN, finished=[finish("r00000", 0, 2000), finish("r00001", 1, 2001, 0.25)]
    )
    assert [(r.episode, r.reward) for r in await catalog.results_page(RUN)] == [
        ("r00001", 1.0),
        ("r00002", 1.0),
    ]
    # The new attempt's finish is a new result, not acknowledged yet.
    await catalog.record_episodes(RUN, finished=[finish("r00000", 0, 3000, 0.75, attempt=1)])
    fresh = await catalog.results_page(RUN, episodes=["r00000"])
    assert [(r.attempt, r.reward, r.capture_key, r.acknowledged_at) for r in fresh] == [
        (1, 0.75, "r00000-a1", None)
    ]
    assert await catalog.acknowledge_results(RUN, ["r00000", "r00001"]) == (2, [])
    assert await catalog.results_page(RUN, unacknowledged=True) == []
    # Analysts read the table with SQL too (docs/catalog.md); deleting the run deletes them.
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT episode, attempt FROM results WHERE run = :run ORDER BY episode"),
                {"run": RUN},
            )
            assert [tuple(row) for row in rows] == [("r00000", 1), ("r00001", 0), ("r00002", 0)]
    finally:
        await engine.dispose()
    await catalog.delete_run(RUN)
    await controlled_run(catalog)
    assert await catalog.results_page(RUN) == []
