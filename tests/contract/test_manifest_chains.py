"""Incremental manifests (catalog revision 0007): a delta amends a retained committed checkpoint;
every read (pages, the ``manifest_entries`` view, restores, an episode's entries, staging keys)
composes the chain; retention keeps what a retained chain names; a downgrade writes deltas
whole. On SQLite and PostgreSQL."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sqlalchemy import text

from rolloutlog.catalog import Catalog, ManifestEntry, open_catalog
from rolloutlog.errors import InvalidRequest, UnknownEpisode
from tests.contract.test_catalog import (
    RUN,
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
    restore_plan,
)

__all__ = ["catalog", "catalog_factory", "catalog_url"]  # fixtures, used by name


def totals(entries: list[ManifestEntry]) -> dict[str, int]:
    counts = Counter(entry.action for entry in entries)
    return {
        "continue": counts["continue"],
        "restart": counts["restart"],
        "finished": counts["finished"],
        "size_bytes": sum(entry.size_bytes for entry in entries),
    }


async def commit_delta(
    catalog: Catalog,
    epoch: int,
    base: int,
    before: list[ManifestEntry],
    after: list[ManifestEntry],
) -> int:
    """Commit ``after`` as a delta over ``base`` (whose manifest is ``before``)."""
    old = {entry.episode: entry for entry in before}
    new = {entry.episode: entry for entry in after}
    changed = [entry for entry in after if old.get(entry.episode) != entry]
    removed = [entry for episode, entry in old.items() if episode not in new]
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(
        RUN,
        checkpoint_id,
        epoch,
        make_offsets(),
        changed,
        base_checkpoint_id=base,
        removed=removed,
        totals=totals(after),
    )
    return checkpoint_id


def churn(entries: list[ManifestEntry], round_: int) -> list[ManifestEntry]:
    """Some entries move on, some go, a new one comes."""
    out = []
    for i, entry in enumerate(entries):
        if i % 5 == round_ % 5:
            continue  # gone (finished and reported earlier, or excluded)
        if i % 3 == round_ % 3:
            entry = entry._replace(
                cut_offset=entry.cut_offset + 100, size_bytes=entry.size_bytes + 1
            )
        out.append(entry)
    out.append(ManifestEntry(f"n{round_:04d}", 0, "continue", round_ % 4, 5, None, ("k",), 9))
    return out


async def stored_parts(url: str, checkpoint_id: int) -> int:
    engine = raw_engine(url)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text("SELECT count(*) FROM manifest_parts WHERE run = :run AND checkpoint_id = :c"),
                {"run": RUN, "c": checkpoint_id},
            )
            return int(result.scalar_one())
    finally:
        await engine.dispose()


async def test_a_chain_of_deltas_reads_as_whole_manifests(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    manifests = [make_entries(40, finished_every=6)]
    base = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(RUN, base, epoch, make_offsets(), manifests[0])
    ids = [base]
    for round_ in range(1, 4):
        manifests.append(churn(manifests[-1], round_))
        ids.append(await commit_delta(catalog, epoch, ids[-1], manifests[-2], manifests[-1]))
    for checkpoint_id, entries in list(zip(ids, manifests, strict=True))[-2:]:  # retained: 2
        assert await catalog.load_manifest(RUN, checkpoint_id) == sorted(entries)
        assert await _view_rows(catalog_url, checkpoint_id) == _as_view_rows(entries)
        stored = await catalog.get_checkpoint(RUN, checkpoint_id)
        assert stored.counts == {k: v for k, v in totals(entries).items() if k != "size_bytes"}
        assert stored.entry_count == len(entries)
        assert stored.size_bytes == sum(e.size_bytes for e in entries)
        page = await catalog.manifest_page(RUN, checkpoint_id, after="r00010", limit=5)
        assert page == [e for e in sorted(entries) if e.episode > "r00010"][:5]
    # The expired whole manifest and deltas stay while the retained chain is made of them.
    assert await stored_parts(catalog_url, ids[0]) > 0
    assert (await catalog.get_checkpoint(RUN, ids[0])).status == "expired"
    assert await _view_rows(catalog_url, ids[0]) == []  # an expired checkpoint has no manifest
    # An episode's entries per kept manifest, composed; a removed one is in none after it.
    gone = next(e for e in manifests[2] if e.episode not in {x.episode for x in manifests[3]})
    named = await catalog.episode_manifest_entries(RUN, gone.episode, gone.cut_partition)
    assert named == [(ids[2], gone)]
    keys = {k for entries in manifests[2:] for e in entries for k in e.staging_keys}
    assert await catalog.staging_keys(RUN) == keys


async def test_a_restore_of_a_delta_checks_the_composed_manifest(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    before = make_entries(30, finished_every=6)
    base = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(RUN, base, epoch, make_offsets(), before)
    after = churn(before, 1)
    delta = await commit_delta(catalog, epoch, base, before, after)
    gone = next(e for e in before if e.episode not in {x.episode for x in after})
    assert gone.action == "continue"
    with pytest.raises(UnknownEpisode):  # a removed episode cannot continue: not in it
        await catalog.commit_restore(
            RUN, epoch, delta, [*restore_plan(after), *restore_plan([gone])], timings_ms={}
        )
    restore = await catalog.commit_restore(RUN, epoch, delta, restore_plan(after), timings_ms={})
    assert restore.continue_count == sum(e.action == "continue" for e in after)


async def test_whole_manifests_end_chains_and_free_the_parts_behind_them(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch = await controlled_run(catalog)
    first = make_entries(20)
    ids = [await catalog.begin_checkpoint(RUN, epoch)]
    await catalog.commit_checkpoint(RUN, ids[0], epoch, make_offsets(), first)
    second = churn(first, 1)
    ids.append(await commit_delta(catalog, epoch, ids[0], first, second))
    for _ in range(2):  # whole again: the chain behind them is no longer needed
        checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
        await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, make_offsets(), second)
        ids.append(checkpoint_id)
    assert [await stored_parts(catalog_url, c) for c in ids[:2]] == [0, 0]
    assert await catalog.load_manifest(RUN, ids[-1]) == sorted(second)


async def test_a_delta_needs_a_retained_committed_base_and_totals(catalog: Catalog) -> None:
    epoch = await controlled_run(catalog)
    entries = make_entries(10)
    base = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(RUN, base, epoch, make_offsets(), entries)
    pending = await catalog.begin_checkpoint(RUN, epoch)
    bad: list[dict[str, Any]] = [
        {"base_checkpoint_id": base + 100, "totals": totals(entries)},  # no such checkpoint
        {"base_checkpoint_id": base},  # no totals
        {"removed": entries[:1]},  # tombstones without a base
        {"base_checkpoint_id": base, "totals": totals(entries), "removed": entries[:1]},
    ]
    for options in bad:
        with pytest.raises(InvalidRequest):
            changed = entries[:1] if "removed" in options else []
            await catalog.commit_checkpoint(RUN, pending, epoch, make_offsets(), changed, **options)
    assert (await catalog.get_checkpoint(RUN, pending)).status == "pending"


async def test_a_downgrade_writes_retained_deltas_whole(catalog_url: str) -> None:
    async with open_catalog(catalog_url) as catalog:
        epoch = await controlled_run(catalog)
        before = make_entries(30, finished_every=4)
        base = await catalog.begin_checkpoint(RUN, epoch)
        await catalog.commit_checkpoint(RUN, base, epoch, make_offsets(), before)
        after = churn(before, 2)
        delta = await commit_delta(catalog, epoch, base, before, after)
    engine = raw_engine(catalog_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_downgrade_to, "0006_manifest_reasons")
    finally:
        await engine.dispose()
    assert await _view_rows(catalog_url, delta) == _as_view_rows(after)
    assert await _view_rows(catalog_url, base) == _as_view_rows(before)
    async with open_catalog(catalog_url) as catalog:
        assert catalog.migrated_from == "0006_manifest_reasons"
        assert await catalog.load_manifest(RUN, delta) == sorted(after)
    assert await _view_rows(catalog_url, delta) == _as_view_rows(after)
