"""Checkpoints written per partition owner: each replica writes its partitions' parts
in one transaction, fenced by its leases; the last part in commits the checkpoint manifest-last;
an aborted checkpoint leaves no part behind; each partition's part is whole or a delta of its own
base, and every read composes each partition's own chain. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from sqlalchemy import text

from rolloutlog.catalog import Catalog, ManifestEntry, PartitionOffset, open_catalog
from rolloutlog.errors import (
    CheckpointInProgress,
    CheckpointNotPending,
    InvalidRequest,
    LeaseLost,
    UnknownCheckpoint,
)
from tests.contract.test_catalog import (
    RUN,
    P,
    _as_view_rows,
    _downgrade_to,
    _view_rows,
    catalog,
    catalog_factory,
    catalog_url,
    controlled_run,
    make_entries,
    make_offsets,
    raw_engine,
)

__all__ = ["catalog", "catalog_factory", "catalog_url"]  # fixtures, used by name

#: Two replicas: A owns partitions 0 and 1, B owns 2 and 3 (``P`` is 4).
A, B = "replica-a", "replica-b"
OWNED = {A: (0, 1), B: (2, 3)}
LEASES = {0: (A, 1), 1: (A, 1), 2: (B, 1), 3: (B, 1)}


async def lease(url: str, owners: Mapping[int, tuple[str, int]], run: str = RUN) -> None:
    """Set partition leases directly: partition → (replica, generation)."""
    engine = raw_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM partition_leases WHERE run = :run"), {"run": run})
            await conn.execute(
                text(
                    "INSERT INTO partition_leases (run, partition, replica_id, generation, "
                    "acquired_at) VALUES (:run, :p, :r, :g, :t)"
                ),
                [
                    {"run": run, "p": p, "r": r, "g": g, "t": time.time()}
                    for p, (r, g) in owners.items()
                ],
            )
    finally:
        await engine.dispose()


async def count_rows(url: str, checkpoint_id: int) -> dict[str, int]:
    """Rows a checkpoint has in each table writers fill."""
    engine = raw_engine(url)
    found = {}
    try:
        async with engine.connect() as conn:
            for table in ("manifest_parts", "checkpoint_offsets", "checkpoint_parts"):
                result = await conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE run = :run AND checkpoint_id = :c"),
                    {"run": RUN, "c": checkpoint_id},
                )
                found[table] = int(result.scalar_one())
    finally:
        await engine.dispose()
    return found


def of(entries: Sequence[ManifestEntry], partitions: Sequence[int]) -> list[ManifestEntry]:
    return [entry for entry in entries if entry.cut_partition in partitions]


def offsets(partitions: Sequence[int]) -> list[PartitionOffset]:
    return [offset for offset in make_offsets() if offset.partition in partitions]


def totals(entries: Sequence[ManifestEntry]) -> dict[str, int]:
    counts = Counter(entry.action for entry in entries)
    return {
        "continue": counts["continue"],
        "restart": counts["restart"],
        "finished": counts["finished"],
        "size_bytes": sum(entry.size_bytes for entry in entries),
    }


async def write(
    catalog: Catalog,
    checkpoint_id: int,
    replica: str,
    manifest: Sequence[ManifestEntry],
    *,
    generation: int = 1,
    base: tuple[int, Sequence[ManifestEntry]] | None = None,
) -> object:
    """``replica`` writes its partitions' parts of ``manifest``: whole, or a delta of ``base``
    (its id and whole manifest)."""
    mine = OWNED[replica]
    after = of(manifest, mine)
    generations = dict.fromkeys(mine, generation)
    if base is None:
        return await catalog.write_checkpoint_parts(
            RUN, checkpoint_id, offsets(mine), after, replica_id=replica, generations=generations
        )
    base_id, before = base
    old = {entry.episode: entry for entry in of(before, mine)}
    new = {entry.episode: entry for entry in after}
    return await catalog.write_checkpoint_parts(
        RUN,
        checkpoint_id,
        offsets(mine),
        [entry for entry in after if old.get(entry.episode) != entry],
        replica_id=replica,
        generations=generations,
        base_checkpoint_id=base_id,
        removed=[entry for episode, entry in old.items() if episode not in new],
        totals=totals(after),
    )


def churn(entries: list[ManifestEntry], round_: int) -> list[ManifestEntry]:
    """Some entries move on, some go, a new one comes in every partition."""
    out = []
    for i, entry in enumerate(entries):
        if i % 5 == round_ % 5:
            continue
        if i % 3 == round_ % 3:
            entry = entry._replace(
                cut_offset=entry.cut_offset + 100, size_bytes=entry.size_bytes + 1
            )
        out.append(entry)
    for p in range(P):
        out.append(ManifestEntry(f"n{round_:02d}{p}", 0, "continue", p, 5, None, (f"k{p}",), 9))
    return out


async def test_parts_from_two_writers_commit_once_all_are_in(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    await lease(catalog_url, LEASES)
    entries = make_entries(40, finished_every=6)
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    assert await write(catalog, checkpoint_id, B, entries) is None
    # Half the parts: still pending, no manifest for anyone to read, not even in the view.
    assert (await catalog.get_checkpoint(RUN, checkpoint_id)).status == "pending"
    with pytest.raises(UnknownCheckpoint):
        await catalog.load_manifest(RUN, checkpoint_id)
    assert await _view_rows(catalog_url, checkpoint_id) == []
    with pytest.raises(InvalidRequest):  # a partition's part is written once
        await write(catalog, checkpoint_id, B, entries)
    committed = await write(catalog, checkpoint_id, A, entries)
    assert committed is not None
    stored = await catalog.get_checkpoint(RUN, checkpoint_id)
    assert stored == committed
    assert stored.status == "committed"
    assert stored.counts == {k: v for k, v in totals(entries).items() if k != "size_bytes"}
    assert stored.entry_count == len(entries)
    assert stored.size_bytes == sum(entry.size_bytes for entry in entries)
    assert stored.offsets == tuple(make_offsets())
    assert (await catalog.get_run(RUN)).latest_checkpoint_id == checkpoint_id
    assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)
    assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)


async def test_a_stale_generation_is_refused_and_writes_nothing(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    # B took partition 1 over from A (generation 2): A still believes it holds it at 1.
    await lease(catalog_url, {0: (A, 1), 1: (B, 2), 2: (B, 1), 3: (B, 1)})
    entries = make_entries(20)
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    with pytest.raises(LeaseLost):
        await write(catalog, checkpoint_id, A, entries)
    assert await count_rows(catalog_url, checkpoint_id) == dict.fromkeys(
        ("manifest_parts", "checkpoint_offsets", "checkpoint_parts"), 0
    )
    await lease(catalog_url, {0: (A, 1), 1: (A, 3), 2: (B, 1), 3: (B, 1)})
    with pytest.raises(LeaseLost):  # a generation it never held either
        await write(catalog, checkpoint_id, A, entries, generation=2)
    assert (await catalog.get_checkpoint(RUN, checkpoint_id)).status == "pending"
    with pytest.raises(InvalidRequest):  # fenced partitions and written ones must agree
        await catalog.write_checkpoint_parts(
            RUN, checkpoint_id, offsets((0,)), [], replica_id=A, generations={0: 1, 1: 3}
        )


async def test_an_aborted_checkpoint_leaves_no_part(catalog_url: str) -> None:
    clock = [1000.0]
    async with open_catalog(catalog_url, clock=lambda: clock[0]) as catalog:
        epoch = await controlled_run(catalog)
        await lease(catalog_url, LEASES)
        entries = make_entries(20)
        first = await catalog.begin_checkpoint(RUN, epoch)
        assert await write(catalog, first, A, entries) is None
        await catalog.abort_checkpoint(RUN, first, epoch, "an owner never wrote")
        assert await count_rows(catalog_url, first) == dict.fromkeys(
            ("manifest_parts", "checkpoint_offsets", "checkpoint_parts"), 0
        )
        # The sweep: pending past its deadline and the grace, whoever asked for it is gone.
        second = await catalog.begin_checkpoint(RUN, epoch, deadline_s=2.0)
        assert await write(catalog, second, B, entries) is None
        clock[0] += 2.5
        assert await catalog.abort_overdue_checkpoints(30.0, 1.0) == []
        clock[0] += 1.0
        assert await catalog.abort_overdue_checkpoints(30.0, 1.0) == [(RUN, second)]
        found = await catalog.get_checkpoint(RUN, second)
        assert found.status == "aborted"
        assert found.reason is not None and "deadline" in found.reason
        assert await count_rows(catalog_url, second) == dict.fromkeys(
            ("manifest_parts", "checkpoint_offsets", "checkpoint_parts"), 0
        )
        with pytest.raises(CheckpointNotPending):  # the last part comes too late
            await write(catalog, second, A, entries)
        # A take-over aborts the pending checkpoint: its parts go too.
        third = await catalog.begin_checkpoint(RUN, epoch)
        assert await write(catalog, third, A, entries) is None
        await catalog.take_over_controller(RUN)
        assert (await catalog.get_checkpoint(RUN, third)).status == "aborted"
        assert (await count_rows(catalog_url, third))["manifest_parts"] == 0


async def expire_replica(url: str, replica: str) -> None:
    """Let ``replica``'s heartbeat lapse now (as its lease would, killed or paused)."""
    engine = raw_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE replicas SET expires_at = 0 WHERE replica_id = :r"), {"r": replica}
            )
    finally:
        await engine.dispose()


async def test_a_live_requesters_pending_checkpoint_refuses_the_next(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    for replica in (A, B):
        await catalog.lease_tick(replica, lease_s=60.0, held={}, fresh=True)
    first = await catalog.begin_checkpoint(RUN, epoch, requested_by=A)
    with pytest.raises(CheckpointInProgress) as refused:
        await catalog.begin_checkpoint(RUN, epoch, requested_by=B)
    assert refused.value.details["checkpoint_id"] == first
    # A requester's own renewal (the same process) keeps it pending.
    await catalog.lease_tick(A, lease_s=60.0, held={})
    with pytest.raises(CheckpointInProgress):
        await catalog.begin_checkpoint(RUN, epoch, requested_by=B)
    assert (await catalog.get_checkpoint(RUN, first)).status == "pending"


async def test_an_orphaned_checkpoint_is_superseded_and_never_commits(
    catalog: Catalog, catalog_url: str
) -> None:
    """The requester's lease lapsed: the next request aborts its checkpoint in the same
    transaction that begins the next one; the orphan's parts are gone and a part written for it
    afterwards is refused; the new checkpoint commits with the same writers."""
    epoch = await controlled_run(catalog)
    await lease(catalog_url, LEASES)
    for replica in (A, B):
        await catalog.lease_tick(replica, lease_s=60.0, held={}, fresh=True)
    await lease(catalog_url, LEASES)  # the ticks balanced the run: set the test's leases again
    entries = make_entries(20)
    orphan = await catalog.begin_checkpoint(RUN, epoch, requested_by=A)
    assert await write(catalog, orphan, B, entries) is None
    await expire_replica(catalog_url, A)
    second = await catalog.begin_checkpoint(RUN, epoch, requested_by=B)
    assert second == orphan + 1
    found = await catalog.get_checkpoint(RUN, orphan)
    assert found.status == "aborted"
    assert found.reason == (
        f"superseded by checkpoint {second}: the lease of its requester {A!r} lapsed"
    )
    assert await count_rows(catalog_url, orphan) == dict.fromkeys(
        ("manifest_parts", "checkpoint_offsets", "checkpoint_parts"), 0
    )
    with pytest.raises(CheckpointNotPending):  # the orphan's last part comes too late
        await write(catalog, orphan, A, entries)
    assert await write(catalog, second, B, entries) is None
    committed = await write(catalog, second, A, entries)
    assert committed is not None and committed.status == "committed"
    assert (await catalog.get_run(RUN)).latest_checkpoint_id == second


async def test_a_requester_restarted_under_its_id_is_gone(catalog_url: str) -> None:
    clock = [1000.0]
    async with open_catalog(catalog_url, clock=lambda: clock[0]) as catalog:
        epoch = await controlled_run(catalog)
        await catalog.lease_tick(A, lease_s=1e9, held={}, fresh=True)
        orphan = await catalog.begin_checkpoint(RUN, epoch, requested_by=A)
        clock[0] += 1.0
        if catalog.backend == "postgresql":  # the lease clock is the database's
            await asyncio.sleep(0.01)
        await catalog.lease_tick(A, lease_s=1e9, held={}, fresh=True)  # a new process
        second = await catalog.begin_checkpoint(RUN, epoch, requested_by=A)
        found = await catalog.get_checkpoint(RUN, orphan)
        assert found.status == "aborted"
        assert found.reason == f"superseded by checkpoint {second}: its requester {A!r} restarted"


async def test_a_checkpoint_naming_no_requester_is_never_superseded(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    await catalog.lease_tick(A, lease_s=60.0, held={}, fresh=True)
    first = await catalog.begin_checkpoint(RUN, epoch)
    await expire_replica(catalog_url, A)
    with pytest.raises(CheckpointInProgress):
        await catalog.begin_checkpoint(RUN, epoch, requested_by=A)
    assert (await catalog.get_checkpoint(RUN, first)).status == "pending"


async def test_a_start_aborts_only_what_no_live_replica_finishes(
    catalog_url: str, catalog_factory: Any
) -> None:
    """A replica starting (its catalog's start, then its coordinator's for its own id) leaves
    the checkpoint another live replica is taking alone."""
    first = await catalog_factory()
    epoch = await controlled_run(first)
    await first.create_run("other", partitions=P)
    other_epoch = await first.take_over_controller("other")
    for replica in (A, B):
        await first.lease_tick(replica, lease_s=60.0, held={}, fresh=True)
    live = await first.begin_checkpoint(RUN, epoch, requested_by=A)
    mine = await first.begin_checkpoint("other", other_epoch, requested_by=B)
    await first.stop()
    restarted = await catalog_factory()  # B's process starting again
    assert (await restarted.get_checkpoint(RUN, live)).status == "pending"
    assert (await restarted.get_checkpoint("other", mine)).status == "pending"
    assert await restarted.abort_pending_checkpoints("restarted", requested_by=B) == [
        ("other", mine)
    ]
    assert (await restarted.get_checkpoint(RUN, live)).status == "pending"
    await expire_replica(catalog_url, A)
    assert await restarted.abort_pending_checkpoints("start") == [(RUN, live)]


async def mixed_chains(
    catalog: Catalog, url: str, rounds: int = 2
) -> tuple[list[int], list[list[ManifestEntry]]]:
    """Checkpoint 1 whole; 2: A's partitions a delta of 1, B's whole; 3: both deltas of 2
    (A's chain three deep, B's two)."""
    epoch = await controlled_run(catalog)
    await lease(url, LEASES)
    manifests = [make_entries(60, finished_every=6)]
    ids = [await catalog.begin_checkpoint(RUN, epoch)]
    await write(catalog, ids[0], A, manifests[0])
    await write(catalog, ids[0], B, manifests[0])
    for round_ in range(1, rounds + 1):
        manifests.append(churn(manifests[-1], round_))
        ids.append(await catalog.begin_checkpoint(RUN, epoch))
        base = (ids[-2], manifests[-2])
        await write(catalog, ids[-1], A, manifests[-1], base=base)
        await write(catalog, ids[-1], B, manifests[-1], base=base if round_ == 2 else None)
    return ids, manifests


async def test_parts_with_different_bases_compose_per_partition(
    catalog: Catalog, catalog_url: str
) -> None:
    ids, manifests = await mixed_chains(catalog, catalog_url)
    for checkpoint_id, entries in list(zip(ids, manifests, strict=True))[-2:]:  # retained: 2
        assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)
        assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)
        stored = await catalog.get_checkpoint(RUN, checkpoint_id)
        assert stored.entry_count == len(entries)
        assert stored.size_bytes == sum(entry.size_bytes for entry in entries)
        page = await catalog.manifest_page(RUN, checkpoint_id, after="r00030", limit=9)
        assert page == [e for e in sorted(entries) if e.episode > "r00030"][:9]
    # Retention: checkpoint 1 expired; A's parts of it stay (A's chains of 3 name them), B's
    # went (its whole parts at 2 cut B's chains).
    engine = raw_engine(catalog_url)
    try:
        async with engine.connect() as conn:
            kept = await conn.execute(
                text(
                    "SELECT cut_partition FROM manifest_parts WHERE run = :run AND "
                    "checkpoint_id = :c ORDER BY cut_partition"
                ),
                {"run": RUN, "c": ids[0]},
            )
            assert [row[0] for row in kept] == list(OWNED[A])
    finally:
        await engine.dispose()
    # An episode's entries per kept manifest, composed through its own partition's chain.
    for partition in range(P):
        moved = next(
            e for e in manifests[2] if e.cut_partition == partition and e not in manifests[1]
        )
        named = await catalog.episode_manifest_entries(RUN, moved.episode, partition)
        assert named[-1] == (ids[2], moved)
    keys = {k for entries in manifests[1:] for e in entries for k in e.staging_keys}
    assert await catalog.staging_keys(RUN) == keys


async def test_a_downgrade_writes_mixed_chains_whole(catalog_url: str) -> None:
    async with open_catalog(catalog_url) as catalog:
        ids, manifests = await mixed_chains(catalog, catalog_url, rounds=1)
    engine = raw_engine(catalog_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_downgrade_to, "0008_replicas")
    finally:
        await engine.dispose()
    for checkpoint_id, entries in zip(ids, manifests, strict=True):
        assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)
    async with open_catalog(catalog_url) as catalog:
        assert catalog.migrated_from == "0008_replicas"
        for checkpoint_id, entries in zip(ids, manifests, strict=True):
            assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)


async def test_a_request_id_finds_its_own_checkpoint_only(catalog: Catalog) -> None:
    """Each checkpoint keeps the request id it was begun for: a request sent again finds its
    own (the newest begun for it), never another request's however recent; one whose
    checkpoint committed is not begun again; one whose checkpoint was aborted begins again
    under the same id. A request naming none is as before."""
    epoch = await controlled_run(catalog)
    other = await catalog.begin_checkpoint(RUN, epoch, request_id="other")
    await catalog.commit_checkpoint(RUN, other, epoch, make_offsets(), make_entries(5))
    assert await catalog.checkpoint_of_request(RUN, "mine") is None
    first = await catalog.begin_checkpoint(RUN, epoch, request_id="mine")
    await catalog.abort_checkpoint(RUN, first, epoch, "its parts did not all come")
    again = await catalog.begin_checkpoint(RUN, epoch, request_id="mine")
    found = await catalog.checkpoint_of_request(RUN, "mine")
    assert found is not None and (found.checkpoint_id, found.status) == (again, "pending")
    assert found.request_id == "mine"
    with pytest.raises(CheckpointInProgress):  # its own pending one: as any pending one
        await catalog.begin_checkpoint(RUN, epoch, request_id="mine")
    await catalog.commit_checkpoint(RUN, again, epoch, make_offsets(), make_entries(5))
    with pytest.raises(CheckpointInProgress) as refused:  # committed: that is the answer
        await catalog.begin_checkpoint(RUN, epoch, request_id="mine")
    assert refused.value.details == {"run": RUN, "checkpoint_id": again, "request_id": "mine"}
    listed = await catalog.list_checkpoints(RUN, request_id="mine")
    assert [(c.checkpoint_id, c.status) for c in listed] == [
        (again, "committed"),
        (first, "aborted"),
    ]
    theirs = await catalog.checkpoint_of_request(RUN, "other")
    assert theirs is not None and theirs.checkpoint_id == other
    plain = await catalog.begin_checkpoint(RUN, epoch)
    assert (await catalog.get_checkpoint(RUN, plain)).request_id is None
    assert [c.checkpoint_id for c in await catalog.list_checkpoints(RUN, limit=2)] == [
        plain,
        again,
    ]
    with pytest.raises(InvalidRequest):
        await catalog.begin_checkpoint(RUN, epoch, request_id="x" * 65)
