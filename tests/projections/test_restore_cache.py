"""The restore cache (issue 16): bounded by bytes, a run's newest restore supersedes its older
ones, and what was dropped is rebuilt from the log, equal to what was served before."""

from __future__ import annotations

from pathlib import Path

from rolloutlog.projections import CheckpointResult
from rolloutlog.projections._restorer import ProjectionCache, projection_bytes
from tests import factories as f
from tests.projections.conftest import Service, open_service


async def _restored(service: Service) -> int:
    checkpoint = await service.checkpoint()
    assert isinstance(checkpoint, CheckpointResult)
    # A policy version no cut exceeds takes the replaying path, which caches the projections.
    result = await service.restore(policy_version=10**6)
    restore_id: int = result.restore.restore_id
    return restore_id


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
        assert ("run", first) in cache
        before = (await service.coordinator.restore_projections("run", first))["a"]
        second = await _restored(service)
        assert ("run", second) in cache and ("run", first) not in cache
        # The older restore is rebuilt from the log, the same as it was served, and not kept.
        again = (await service.coordinator.restore_projections("run", first))["a"]
        assert again == before
        assert ("run", first) not in cache and ("run", second) in cache
        assert cache.size_bytes == projection_bytes(
            (await service.coordinator.restore_projections("run", second))["a"]
        )
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
        restore_id = await _restored(service)
        projections = await service.coordinator.restore_projections("run", restore_id)
        size = projection_bytes(projections["a"])
        # The ledger's 2,000 ids are most of it: counted, unlike the payload bytes alone.
        assert size > len(projections["a"].ledger[0].token_ids_json) > 8000
        cache = ProjectionCache(budget_bytes=size * 2)
        cache.put("r1", 1, projections)
        cache.put("r2", 1, projections)
        assert ("r1", 1) in cache and ("r2", 1) in cache and cache.size_bytes == 2 * size
        cache.put("r3", 1, projections)  # over the budget: the oldest other entry goes
        assert ("r3", 1) in cache and cache.size_bytes <= 2 * size
        assert ("r1", 1) not in cache and ("r2", 1) in cache
        big = ProjectionCache(budget_bytes=size // 2)
        big.put("r1", 3, projections)  # the newest is kept even over the budget
        assert ("r1", 3) in big
        big.put("r1", 2, projections)  # an older restore rebuilt on demand is not kept
        assert ("r1", 2) not in big and ("r1", 3) in big
    finally:
        await service.close()


async def test_a_first_fetch_streams_each_projection_once_the_read_passes_its_cut(
    tmp_path: Path,
) -> None:
    """One partition: ``a``'s cut is on the log's first page, ``b``'s 1,500 records later. The
    stream (as after a restart: nothing cached) hands ``a`` out before reading ``b``'s last page,
    and the streamed projections are those the restore served from its replay."""
    service = await open_service(tmp_path, partitions=1)
    try:
        await service.append(f.started("a"), f.boundary("a", "seed", {"turn": 1}))
        await service.append(f.started("b"))
        for start in range(0, 1500, 500):
            await service.append(
                *(f.boundary("b", "seed", {"turn": n}) for n in range(start, start + 500))
            )
        restore_id = await _restored(service)
        served = await service.coordinator.restore_projections("run", restore_id)
        service.coordinator._restore_cache.forget_run("run")
        stream = await service.coordinator.restore_projection_stream("run", restore_id)
        streamed = [projection async for projection in stream]
        assert [p.episode for p in streamed] == ["a", "b"]
        assert {p.episode: p for p in streamed} == served
        assert streamed[1].boundaries["environment"].state.value() == {"turn": 1499}
        assert ("run", restore_id) in service.coordinator._restore_cache  # cached once complete
    finally:
        await service.close()
