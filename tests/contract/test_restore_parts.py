"""Restores planned per partition owner: a request's parts are fenced by the writer's
partition leases, its commit checks every part's lease in the restore's own transaction, and a
request that does not commit is aborted (by its requester, or by any replica's sweep past its
deadline). On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import insert

from rolloutlog.catalog import Catalog, ManifestEntry
from rolloutlog.catalog._schema import partition_leases
from rolloutlog.errors import LeaseLost, RestoreConflict, StaleController
from tests.contract.test_catalog import (
    RUN,
    CatalogFactory,
    P,
    catalog,
    catalog_factory,
    catalog_url,
    commit,
    controlled_run,
    make_entries,
    raw_engine,
    restore_plan,
)

__all__ = ["catalog", "catalog_factory", "catalog_url"]  # fixtures, used by name

REQUEST = {"exclude": ["e0"], "exclude_results": False, "policy_version": None}


async def set_leases(url: str, owners: dict[int, tuple[str, int]], run: str = RUN) -> None:
    """Write the run's lease rows directly (what the lease loop would claim)."""
    engine = raw_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(partition_leases.delete().where(partition_leases.c.run == run))
            await conn.execute(
                insert(partition_leases),
                [
                    {
                        "run": run,
                        "partition": p,
                        "replica_id": owner,
                        "generation": generation,
                        "acquired_at": 0.0,
                    }
                    for p, (owner, generation) in owners.items()
                ],
            )
    finally:
        await engine.dispose()


async def opened(
    catalog: Catalog, deadline_s: float = 60.0
) -> tuple[int, int, list[ManifestEntry]]:
    epoch = await controlled_run(catalog)
    entries = make_entries(8)
    checkpoint_id = await commit(catalog, epoch, entries)
    assert (
        await catalog.open_restore(
            RUN, epoch, checkpoint_id, requested_by="r1", request=REQUEST, deadline_s=deadline_s
        )
        == 1
    )
    return epoch, checkpoint_id, entries


async def test_a_request_reserves_its_id_and_plans_until_it_commits(
    catalog: Catalog, catalog_url: str
) -> None:
    epoch, checkpoint_id, entries = await opened(catalog)
    with pytest.raises(StaleController):
        await catalog.open_restore(
            RUN, epoch + 1, checkpoint_id, requested_by="r1", request={}, deadline_s=5
        )
    (request,) = await catalog.planning_restores()
    assert (request.run, request.restore_id, request.status) == (RUN, 1, "planning")
    assert (request.requested_by, dict(request.request)) == ("r1", REQUEST)
    assert request.deadline_at - request.requested_at == pytest.approx(60.0)
    assert await catalog.planning_restores("other") == []
    # Two owners, each at its own generation.
    await set_leases(catalog_url, {p: ("r1" if p < 2 else "r2", 3 + p) for p in range(P)})
    await catalog.write_restore_parts(RUN, 1, "r1", {0: 3, 1: 4}, {0: ["a"], 1: ["b"]})
    await catalog.write_restore_parts(RUN, 1, "r2", {2: 5, 3: 6}, {2: ["c"], 3: []})
    parts = await catalog.restore_parts(RUN, 1)
    assert [(x.partition, x.replica_id, x.generation, x.body) for x in parts] == [
        (0, "r1", 3, ["a"]),
        (1, "r1", 4, ["b"]),
        (2, "r2", 5, ["c"]),
        (3, "r2", 6, []),
    ]
    fences = {"r1": {0: 3, 1: 4}, "r2": {2: 5, 3: 6}}
    restore = await catalog.commit_restore(
        RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=1, fences=fences
    )
    assert restore.restore_id == 1
    ended = await catalog.get_restore_request(RUN, 1)
    assert (ended.status, ended.reason) == ("committed", None)
    assert ended.ended_at is not None
    assert await catalog.planning_restores() == []
    # Committed: no more parts, no abort.
    with pytest.raises(RestoreConflict):
        await catalog.write_restore_parts(RUN, 1, "r1", {0: 3}, {0: []})
    assert not await catalog.abort_restore(RUN, 1, "too late")


async def test_a_part_is_fenced_by_its_writers_generation(
    catalog: Catalog, catalog_url: str
) -> None:
    await opened(catalog)
    await set_leases(catalog_url, {0: ("r1", 2), 1: ("r2", 7), 2: ("r2", 7), 3: ("r2", 7)})
    with pytest.raises(LeaseLost):  # r1 was at 1; its partition moved on (a zombie)
        await catalog.write_restore_parts(RUN, 1, "r1", {0: 1}, {0: []})
    with pytest.raises(LeaseLost):  # not its partition at all
        await catalog.write_restore_parts(RUN, 1, "r1", {1: 7}, {1: []})
    with pytest.raises(LeaseLost):  # all or nothing: one stale partition refuses the part
        await catalog.write_restore_parts(RUN, 1, "r2", {1: 7, 2: 6}, {1: [], 2: []})
    assert await catalog.restore_parts(RUN, 1) == []
    await catalog.write_restore_parts(RUN, 1, "r1", {0: 2}, {0: ["x"]})
    assert [p.partition for p in await catalog.restore_parts(RUN, 1)] == [0]


async def test_the_commit_checks_every_parts_lease(catalog: Catalog, catalog_url: str) -> None:
    epoch, checkpoint_id, entries = await opened(catalog)
    await set_leases(catalog_url, {p: ("r1" if p < 2 else "r2", 1) for p in range(P)})
    await catalog.write_restore_parts(RUN, 1, "r2", {2: 1, 3: 1}, {2: [], 3: []})
    # r2 loses partition 3 after writing its part: the plan it wrote may be stale.
    await set_leases(
        catalog_url, {p: ("r1" if p < 2 else "r2", 1) for p in range(3)} | {3: ("r3", 2)}
    )
    fences = {"r1": {0: 1, 1: 1}, "r2": {2: 1, 3: 1}}
    with pytest.raises(LeaseLost):
        await catalog.commit_restore(
            RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=1, fences=fences
        )
    assert await catalog.list_restores(RUN) == []
    assert await catalog.current_attempts(RUN) == {}
    assert (await catalog.get_restore_request(RUN, 1)).status == "planning"
    assert await catalog.abort_restore(RUN, 1, "a part's owner lost its lease")
    ended = await catalog.get_restore_request(RUN, 1)
    assert (ended.status, ended.reason) == ("aborted", "a part's owner lost its lease")
    with pytest.raises(RestoreConflict):  # aborted: never commits
        await catalog.commit_restore(
            RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=1, fences={}
        )
    with pytest.raises(RestoreConflict):
        await catalog.write_restore_parts(RUN, 1, "r1", {0: 1}, {0: []})
    # The id stays unused; the next request takes the next one and commits.
    second = await catalog.open_restore(
        RUN, epoch, checkpoint_id, requested_by="r1", request={}, deadline_s=5
    )
    assert second == 2
    restore = await catalog.commit_restore(
        RUN, epoch, checkpoint_id, restore_plan(entries), restore_id=2, fences={}
    )
    assert restore.restore_id == 2


async def test_the_sweep_aborts_requests_past_their_deadline(
    catalog_factory: CatalogFactory,
) -> None:
    now = [1000.0]
    catalog = await catalog_factory(clock=lambda: now[0])
    epoch = await controlled_run(catalog)
    checkpoint_id = await commit(catalog, epoch, make_entries(4))
    first = await catalog.open_restore(
        RUN, epoch, checkpoint_id, requested_by="r1", request={}, deadline_s=5
    )
    second = await catalog.open_restore(
        RUN, epoch, checkpoint_id, requested_by="r2", request={}, deadline_s=50
    )
    now[0] += 10
    assert await catalog.abort_expired_restores() == 1
    assert [r.restore_id for r in await catalog.planning_restores()] == [second]
    swept = await catalog.get_restore_request(RUN, first)
    assert (swept.status, swept.ended_at) == ("aborted", 1010.0)
    assert swept.reason is not None and "deadline" in swept.reason
    assert await catalog.abort_expired_restores() == 0
    # Deleted with its run.
    await catalog.delete_run(RUN)
    assert await catalog.planning_restores() == []
