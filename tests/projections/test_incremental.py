"""Incremental checkpoints: a checkpoint after a committed one stores only the entries
whose episodes changed, and tombstones for those that went; read back, it is the manifest a
fresh service would capture; restores of it continue the same episodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from rolloutlog.catalog import ManifestEntry
from rolloutlog.projections import CheckpointResult
from tests import factories as f
from tests.projections.conftest import Service, open_service


async def committed(service: Service) -> CheckpointResult:
    result = await service.checkpoint()
    assert isinstance(result, CheckpointResult)
    return result


async def stored(service: Service, checkpoint_id: int) -> list[list[object]]:
    """The packed entries a checkpoint's own parts hold (not composed)."""
    import orjson

    engine = service.catalog._engine  # the catalog's own database, read as stored
    assert engine is not None
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT entries FROM manifest_parts WHERE run = :run AND checkpoint_id = :c"),
            {"run": service.run, "c": checkpoint_id},
        )
        return sorted(
            (entry for (body,) in rows.all() for entry in orjson.loads(body)),
            key=lambda e: str(e[0]),
        )


def comparable(entries: list[ManifestEntry]) -> dict[str, tuple[object, ...]]:
    """Entries without their cut offset (an unchanged one keeps its earlier cut)."""
    return {e.episode: (e.attempt, e.action, e.last_stage, e.staging_keys) for e in entries}


async def test_a_checkpoint_stores_what_changed_and_reads_whole(
    service: Service, tmp_path: Path, deployment: dict[str, Any]
) -> None:
    quiet = [f"q{i:02d}" for i in range(12)]  # a delta is written while it amends < half
    for name in ("a", "b", *quiet):
        await service.append(f.started(name), f.boundary(name, "seed", {"t": 1}))
    await service.append(f.started("e"), f.boundary("e"), f.finished("e"))
    first = await committed(service)
    assert len(await stored(service, first.checkpoint.checkpoint_id)) == 15  # whole
    await service.append(f.boundary("a", "invoke_agent", {"t": 2}))  # a changes
    await service.append(f.finished("b"))  # b finishes
    await service.append(f.started("z"), f.boundary("z"))  # z begins
    second = await committed(service)
    delta = await stored(service, second.checkpoint.checkpoint_id)
    # a, b and z changed; e was reported finished by the first: a tombstone.
    assert [(e[0], e[2]) for e in delta] == [
        ("a", "continue"),
        ("b", "finished"),
        ("e", "removed"),
        ("z", "continue"),
    ]
    manifest = await service.catalog.load_manifest(service.run, second.checkpoint.checkpoint_id)
    assert {e.episode: e.action for e in manifest} == {
        "a": "continue",
        "b": "finished",
        "z": "continue",
        **{name: "continue" for name in quiet},
    }
    assert second.checkpoint.counts == {"continue": 14, "restart": 0, "finished": 1}
    assert second.checkpoint.entry_count == 15
    # Unchanged entries keep the first checkpoint's cut.
    firsts = {
        e.episode: e
        for e in await service.catalog.load_manifest(service.run, first.checkpoint.checkpoint_id)
    }
    for entry in manifest:
        if entry.episode in quiet:
            assert entry == firsts[entry.episode]
    # A fresh service over the same log and catalog captures the same manifest, whole.
    await service.close()
    again = await open_service(tmp_path, **deployment)
    try:
        third = await again.checkpoint()
        assert isinstance(third, CheckpointResult)
        whole = await again.catalog.load_manifest(again.run, third.checkpoint.checkpoint_id)
        assert len(await stored(again, third.checkpoint.checkpoint_id)) == 14  # b reported
        after = comparable(manifest)
        del after["b"]
        assert comparable(whole) == after
        result = await again.restore()
        assert result.restore.counts == {"continue": 14, "restart": 0, "excluded": 0}
    finally:
        await again.close()


async def test_a_restore_of_a_delta_continues_every_episode(service: Service) -> None:
    names = [f"r{i}" for i in range(6)]
    for name in names:
        await service.append(f.started(name), f.boundary(name, "seed", {"t": 1}))
    await committed(service)
    await service.append(f.boundary("r1", "invoke_agent", {"t": 2}))
    second = await committed(service)
    assert len(await stored(service, second.checkpoint.checkpoint_id)) == 1
    result = await service.restore()
    assert result.restore.checkpoint_id == second.checkpoint.checkpoint_id
    assert result.restore.counts == {"continue": 6, "restart": 0, "excluded": 0}
    # After the restore every episode has a new attempt: the next checkpoint names each anew.
    third = await committed(service)
    manifest = await service.catalog.load_manifest(service.run, third.checkpoint.checkpoint_id)
    assert {e.episode: e.attempt for e in manifest} == {name: 1 for name in names}


async def test_a_requester_holding_the_base_staging_keys_gets_what_changed(
    service: Service,
) -> None:
    rows = {name: f.ledger_row(name) for name in ("a", "b", "c")}

    def first_row(name: str) -> dict[str, Any]:
        data = rows[name].data
        return {"call_id": "c1", "cum_len": 512, "digest": data.digest}

    for name, row in rows.items():
        await service.append(f.started(name), row, f.boundary(name, "seed", {"t": 1}))

    async def keys_of(result: CheckpointResult) -> set[str]:
        manifest = await service.catalog.load_manifest(service.run, result.checkpoint.checkpoint_id)
        return {key for entry in manifest for key in entry.staging_keys}

    first = await committed(service)
    assert first.staging_delta is None and first.staging_keys is not None
    held = set(first.staging_keys)
    assert held == await keys_of(first) == {"stage-a-c1", "stage-b-c1", "stage-c-c1"}
    # a references a second key, b finishes (the trainer has its rows), d begins with one.
    await service.append(
        f.ledger_row("a", "c2", parent=first_row("a")),
        f.boundary("a", "invoke_agent", {"t": 2}),
    )
    await service.append(f.finished("b"))
    await service.append(f.started("d"), f.ledger_row("d"), f.boundary("d", "seed", {"t": 1}))
    first_id = first.checkpoint.checkpoint_id
    second = await committed_since(service, first_id)
    delta = second.staging_delta
    assert second.staging_keys is None and delta is not None
    assert (delta.since, sorted(delta.added), sorted(delta.removed)) == (
        first_id,
        ["stage-a-c2", "stage-d-c1"],
        ["stage-b-c1"],
    )
    held = (held - set(delta.removed)) | set(delta.added)
    assert held == await keys_of(second) and delta.count == len(held)
    # Naming a checkpoint that is not the base (a lost reply, another client): every key.
    await service.append(f.boundary("c", "invoke_agent", {"t": 2}))
    third = await committed_since(service, first_id)
    assert third.staging_delta is None and third.staging_keys is not None
    assert set(third.staging_keys) == await keys_of(third)
    # After a reply that listed every key, naming it gets a delta again (nothing changed).
    fourth = await committed_since(service, third.checkpoint.checkpoint_id)
    assert fourth.staging_keys is None and fourth.staging_delta is not None
    assert (fourth.staging_delta.added, fourth.staging_delta.removed) == ((), ())
    assert fourth.staging_delta.count == len(await keys_of(fourth))


async def committed_since(service: Service, since: int) -> CheckpointResult:
    result = await service.checkpoint(staging_since=since)
    assert isinstance(result, CheckpointResult)
    return result


async def test_the_log_is_trimmed_only_where_the_floor_rose(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    trim = service.log.trim

    async def counted(run: str, partition: int, before: int) -> bool:
        calls.append((partition, before))
        return await trim(run, partition, before)

    monkeypatch.setattr(service.log, "trim", counted)
    checkpointer = service.coordinator._checkpointer
    await service.append(f.started("a"), f.boundary("a"), f.finished("a"))
    for _ in range(3):  # a's partition: its floor is past a's records
        await committed(service)
    await checkpointer._trim(service.run)
    if not calls or not await trim(service.run, *calls[0]):
        pytest.skip("this log cannot trim")
    floors = set(calls)
    calls.clear()
    for _ in range(2):  # the floors stay: no write into the log
        await committed(service)
        await checkpointer._trim(service.run)
    assert calls == []
    checkpointer._trimmed.clear()  # as a restarted service: trimmed again, once
    await checkpointer._trim(service.run)
    assert set(calls) == floors


async def test_a_restore_takes_the_projectors_own_manifest_only_as_the_catalog_holds_it(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone projector's newest committed capture (``committed_manifest``) is the catalog's
    manifest of that checkpoint, entry for entry and in its order, whole or a delta, with
    restarts' reasons and finished entries; a restore of it reads no manifest. Any other
    checkpoint's, or one amended by a newer capture, is the catalog's business."""
    projector = service.coordinator.projectors[service.run]
    quiet = [f"q{i:02d}" for i in range(12)]
    for name in ("a", "b", *quiet):
        await service.append(f.started(name), f.boundary(name, "seed", {"t": 1}))
    await service.append(f.started("c"), f.session_started("c", "s1", "restart_only"))
    await service.append(f.started("e"), f.boundary("e"), f.finished("e"))
    checkpoints = []
    for changes in (
        (),
        (f.boundary("a", "invoke_agent", {"t": 2}), f.finished("b"), f.started("z")),
        (f.boundary("z", "seed", {"t": 3}), f.started("y"), f.boundary("c", "verify")),
    ):
        if changes:
            await service.append(*changes)
        checkpoint_id = (await committed(service)).checkpoint.checkpoint_id
        checkpoints.append(checkpoint_id)
        mine = projector.committed_manifest(checkpoint_id)
        assert mine == await service.catalog.load_manifest(service.run, checkpoint_id)
        assert [type(e.staging_keys) for e in mine] == [tuple] * len(mine)
    assert len(await stored(service, checkpoints[1])) < 15  # a delta
    reasons = {e.episode: e.reason for e in mine if e.action == "restart"}
    assert reasons and all(reasons.values())
    assert projector.committed_manifest(checkpoints[0]) is None  # not the base
    loads: list[int] = []
    load_manifest = service.catalog.load_manifest

    async def counted(run: str, checkpoint_id: int) -> list[ManifestEntry]:
        loads.append(checkpoint_id)
        return await load_manifest(run, checkpoint_id)

    monkeypatch.setattr(service.catalog, "load_manifest", counted)
    result = await service.restore(checkpoint_id=checkpoints[-1])
    assert loads == []
    assert result.restore.counts == {"continue": 15, "restart": 1, "excluded": 0}
    result = await service.restore(checkpoint_id=checkpoints[1])  # not the base: read
    assert loads == [checkpoints[1]]
    # A newer capture composed over the base amends its entries in place: read from then on.
    capture = projector.begin_capture(checkpoints[-1] + 1)
    capture.whole = {}
    assert projector.committed_manifest(checkpoints[-1]) is None
