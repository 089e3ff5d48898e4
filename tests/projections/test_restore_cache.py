"""The restore cache: NDJSON lines bounded by bytes, a run's newest restore
supersedes its older ones, what was dropped is rebuilt from the log equal to what was served
before, and a restore's lines are built while it commits."""

from __future__ import annotations

from pathlib import Path

from rolloutlog.api._http import dumps
from rolloutlog.projections import CheckpointResult, ProjectionLine
from rolloutlog.projections._projection_server import ProjectionCache, RestoreLines
from tests import factories as f
from tests.projections.conftest import Service, open_service


async def _restored(service: Service, **kw: object) -> int:
    checkpoint = await service.checkpoint()
    assert isinstance(checkpoint, CheckpointResult)
    result = await service.restore(**kw)
    restore_id: int = result.restore.restore_id
    return restore_id


async def _lines(service: Service, restore_id: int) -> dict[str, ProjectionLine]:
    lines = await service.coordinator.restore_projection_lines("run", restore_id)
    return await lines.complete()


def _built(*lines: ProjectionLine) -> RestoreLines:
    out = RestoreLines()
    for line in lines:
        out.add(line)
    out.finish()
    return out


async def test_lines_are_the_projections_encoded_once(tmp_path: Path) -> None:
    """Each served line is ``ProjectionOut`` as the routes encoded it before (opaque states
    spliced raw), whether the plan replayed (a policy) or pinned its trackers (none)."""
    service = await open_service(tmp_path)
    try:
        await service.append(
            f.started("a"),
            f.ledger_row("a", "c1", list(range(300))),
            f.boundary("a", "seed", {"turn": 1}),
        )
        for kw in ({"policy_version": 10**6}, {}):
            restore_id = await _restored(service, **kw)
            assert ("run", restore_id) in service.coordinator._restore_cache  # built at once
            served = await _lines(service, restore_id)
            replayed = await service.coordinator.restore_projections("run", restore_id)
            assert served.keys() == replayed.keys() == {"a"}
            assert served["a"].line == dumps(replayed["a"].to_json()) + b"\n"
    finally:
        await service.close()


async def test_a_newer_restore_supersedes_the_older_ones(tmp_path: Path) -> None:
    service = await open_service(tmp_path)
    try:
        await service.append(
            f.started("a"),
            f.ledger_row("a", "c1", list(range(300))),
            f.boundary("a", "seed", {"turn": 1}),
        )
        first = await _restored(service)
        cache = service.coordinator._restore_cache
        before = (await _lines(service, first))["a"]
        second = await _restored(service)
        assert ("run", second) in cache and ("run", first) not in cache
        # The older restore is rebuilt from the log, the same as it was served, and not kept.
        again = (await _lines(service, first))["a"]
        assert again == before
        assert ("run", first) not in cache and ("run", second) in cache
        newest = (await _lines(service, second))["a"]
        assert cache.size_bytes == len(newest.line) + 400
    finally:
        await service.close()


async def test_the_budget_drops_other_runs_restores_first(tmp_path: Path) -> None:
    service = await open_service(tmp_path)
    try:
        await service.append(
            f.started("a"),
            f.ledger_row("a", "c1", list(range(2000))),
            f.boundary("a", "seed", {"turn": 1}),
        )
        line = (await _lines(service, await _restored(service)))["a"]
        size = _built(line).size_bytes
        # The ledger's 2,000 ids are most of it.
        assert size > len(line.line) > 8000
        cache = ProjectionCache(budget_bytes=size * 2)
        cache.put("r1", 1, _built(line))
        cache.put("r2", 1, _built(line))
        assert ("r1", 1) in cache and ("r2", 1) in cache and cache.size_bytes == 2 * size
        cache.put("r3", 1, _built(line))  # over the budget: the oldest other entry goes
        assert ("r3", 1) in cache and cache.size_bytes <= 2 * size
        assert ("r1", 1) not in cache and ("r2", 1) in cache
        small = ProjectionCache(budget_bytes=size // 2)
        small.put("r1", 3, _built(line))  # the newest is kept even over the budget
        assert ("r1", 3) in small
        small.put("r1", 2, _built(line))  # an older restore rebuilt on demand is not kept
        assert ("r1", 2) not in small and ("r1", 3) in small
        # A build that grows past the budget drops the others once it is done.
        growing = RestoreLines()
        cache.put("r4", 1, growing)
        for _ in range(3):
            growing.add(line)
        cache.trim(("r4", 1))
        assert list(cache._entries) == [("r4", 1)]
    finally:
        await service.close()


async def test_a_first_fetch_streams_each_projection_once_the_read_passes_its_cut(
    tmp_path: Path,
) -> None:
    """One partition: ``a``'s cut is on the log's first page, ``b``'s 1,500 records later. The
    build (as after a restart: nothing cached) adds ``a`` before reading ``b``'s last page, and
    its lines are those the restore served first."""
    service = await open_service(tmp_path, partitions=1)
    try:
        await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
        await service.append(f.started("b"))
        for start in range(0, 1500, 500):
            await service.append(
                *(f.boundary("b", "seed", {"turn": n}) for n in range(start, start + 500))
            )
        restore_id = await _restored(service)
        served = await _lines(service, restore_id)
        service.coordinator._restore_cache.forget_run("run")
        lines = await service.coordinator.restore_projection_lines("run", restore_id)
        assert await lines.complete() == served
        assert [line.episode for line in lines.lines] == ["a", "b"]  # in the order folded
        assert b'"state":{"turn":1499}' in served["b"].line
        assert ("run", restore_id) in service.coordinator._restore_cache
    finally:
        await service.close()


async def test_a_failed_build_is_dropped_and_its_fetchers_get_the_error(tmp_path: Path) -> None:
    cache = ProjectionCache(budget_bytes=1 << 20)
    lines = RestoreLines()
    cache.put("r", 1, lines)
    error = RuntimeError("log down")
    lines.finish(error)
    cache.drop("r", 1, lines)
    assert ("r", 1) not in cache
    try:
        await lines.complete()
    except RuntimeError as e:
        assert e is error
    else:
        raise AssertionError("no error")
