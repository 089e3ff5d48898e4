"""Partition leases: the tick's claims and releases, the balanced and sticky assignment over the
live replicas (the assignment function's properties under hypothesis), expiry, restarts under
the same id, the generation fence, and the replicas' health reports; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from rolloutlog.catalog import Catalog, open_catalog
from rolloutlog.catalog._leases import assign_partitions, check_leases
from rolloutlog.errors import LeaseLost

RUNS = {"alpha": 8, "beta": 5, "gamma": 1}
LONG = 60.0  # a lease that does not expire during a test

Owned = dict[str, dict[int, int]]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema"))
    return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture
async def catalog(catalog_url: str) -> AsyncIterator[Catalog]:
    async with open_catalog(catalog_url) as catalog:
        for run, partitions in RUNS.items():
            await catalog.create_run(run, partitions=partitions)
        yield catalog


class Replicas:
    """Replica processes as the catalog sees them: each one's id and what it last held."""

    def __init__(self, catalog: Catalog, lease_s: float = LONG) -> None:
        self.catalog = catalog
        self.lease_s = lease_s
        self.held: dict[str, Owned] = {}

    async def tick(self, replica: str) -> Owned:
        fresh = replica not in self.held
        owned = await self.catalog.lease_tick(
            replica, lease_s=self.lease_s, held=self.held.get(replica, {}), fresh=fresh
        )
        self.held[replica] = owned
        return owned

    async def settle(self, replicas: list[str], rounds: int = 6) -> None:
        """Tick every replica in turn until a whole round changes nothing."""
        for _ in range(rounds):
            before = {r: self.held.get(r) for r in replicas}
            for replica in replicas:
                await self.tick(replica)
            if before == {r: self.held[r] for r in replicas}:
                return
        raise AssertionError(f"leases did not settle: {self.held}")


def owners(held: Mapping[str, Owned], run: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for replica, owned in held.items():
        for partition in owned.get(run, {}):
            assert partition not in found, f"{run}/{partition} owned twice"
            found[partition] = replica
    return found


async def test_a_lone_replica_claims_every_partition_at_generation_one(catalog: Catalog) -> None:
    replicas = Replicas(catalog)
    owned = await replicas.tick("r1")
    assert owned == {run: dict.fromkeys(range(p), 1) for run, p in RUNS.items()}
    assert await replicas.tick("r1") == owned  # renewing changes nothing
    listed = await catalog.partition_owners("alpha")
    assert [(o.partition, o.replica_id, o.generation, o.live) for o in listed] == [
        (p, "r1", 1, True) for p in range(8)
    ]


@pytest.mark.parametrize("count", [1, 2, 3])
async def test_the_assignment_is_balanced_and_disjoint(catalog: Catalog, count: int) -> None:
    replicas = Replicas(catalog)
    ids = [f"r{i}" for i in range(1, count + 1)]
    await replicas.settle(ids)
    for run, partitions in RUNS.items():
        found = owners(replicas.held, run)
        assert sorted(found) == list(range(partitions))  # every partition has one owner
        counts = [sum(1 for owner in found.values() if owner == r) for r in ids]
        assert max(counts) - min(counts) <= 1, (run, counts)


async def test_a_partition_changes_hands_released_then_claimed(catalog: Catalog) -> None:
    replicas = Replicas(catalog)
    await replicas.tick("r1")
    assert (await replicas.tick("r2")) == {}  # r1 is live and still holds everything
    moving = [
        p
        for p, r in assign_partitions(
            "alpha", 8, dict.fromkeys(range(8), "r1"), ["r1", "r2"]
        ).items()
        if r == "r2"
    ]
    assert len(moving) == 4
    kept = await replicas.tick("r1")  # r1 lets r2's share go, at the next generation
    assert sorted(kept["alpha"]) == sorted(set(range(8)) - set(moving))
    listed = {o.partition: o for o in await catalog.partition_owners("alpha")}
    assert all(listed[p].replica_id is None and listed[p].generation == 2 for p in moving)
    claimed = await replicas.tick("r2")
    assert claimed["alpha"] == dict.fromkeys(moving, 3)
    assert all(generation == 1 for generation in kept["alpha"].values())


async def test_an_expired_replica_hands_its_partitions_to_the_others(catalog: Catalog) -> None:
    replicas = Replicas(catalog, lease_s=2.0)  # long enough for a loaded machine's ticks
    await replicas.settle(["r1", "r2", "r3"])
    dead = dict(replicas.held.pop("r3"))  # r3 stops ticking
    assert await replicas.tick("r1") == replicas.held["r1"]  # r3 still counts as live
    async with asyncio.timeout(30):
        while any(o.live for o in await catalog.partition_owners("alpha") if o.replica_id == "r3"):
            await replicas.tick("r1")  # the others go on renewing meanwhile
            await replicas.tick("r2")
            await asyncio.sleep(0.2)
    await replicas.settle(["r1", "r2"])
    for run, partitions in RUNS.items():
        found = owners(replicas.held, run)
        assert sorted(found) == list(range(partitions))
        for partition, generation in dead.get(run, {}).items():
            assert replicas.held[found[partition]][run][partition] > generation
    listed = await catalog.partition_owners("alpha")
    assert {o.replica_id for o in listed} == {"r1", "r2"} and all(o.live for o in listed)


async def test_a_released_replica_is_replaced_at_once(catalog: Catalog) -> None:
    replicas = Replicas(catalog)
    await replicas.settle(["r1", "r2"])
    before = replicas.held.pop("r2")
    await catalog.release_leases("r2")
    await replicas.tick("r1")  # no waiting for r2's lease to run out
    assert sorted(replicas.held["r1"]["alpha"]) == list(range(8))
    for partition, generation in before["alpha"].items():
        assert replicas.held["r1"]["alpha"][partition] == generation + 2  # released, claimed


async def test_a_restarted_replica_takes_its_own_back_at_a_new_generation(
    catalog: Catalog,
) -> None:
    replicas = Replicas(catalog)
    first = await replicas.tick("r1")
    del replicas.held["r1"]  # the process died; a new one starts under the same id
    second = await replicas.tick("r1")
    assert second == {run: dict.fromkeys(range(p), 2) for run, p in RUNS.items()}
    assert first != second
    async with catalog._write() as conn:  # the old process's writes are fenced
        with pytest.raises(LeaseLost, match="generation 1"):
            await check_leases(conn, "alpha", "r1", first["alpha"])
        await check_leases(conn, "alpha", "r1", second["alpha"])


async def test_check_leases_refuses_a_stale_generation_or_another_owner(
    catalog: Catalog,
) -> None:
    replicas = Replicas(catalog)
    await replicas.settle(["r1", "r2"])
    mine = replicas.held["r1"]["alpha"]
    partition = next(iter(mine))
    async with catalog._write() as conn:
        await check_leases(conn, "alpha", "r1", mine)
        with pytest.raises(LeaseLost) as stale:
            await check_leases(conn, "alpha", "r1", {partition: mine[partition] - 1})
        assert stale.value.details["partition"] == partition
        with pytest.raises(LeaseLost, match="held by r1"):
            await check_leases(conn, "alpha", "r2", {partition: mine[partition]})


async def test_new_runs_are_claimed_and_deleted_runs_forgotten(catalog: Catalog) -> None:
    replicas = Replicas(catalog)
    await replicas.tick("r1")
    await catalog.create_run("delta", partitions=3)
    assert (await replicas.tick("r1"))["delta"] == {0: 1, 1: 1, 2: 1}
    await catalog.delete_run("delta")
    assert "delta" not in await replicas.tick("r1")


async def test_a_membership_change_moves_only_what_balance_needs(catalog: Catalog) -> None:
    replicas = Replicas(catalog, lease_s=2.0)
    await replicas.settle(["r1", "r2", "r3"])
    before = {run: owners(replicas.held, run) for run in RUNS}
    await replicas.settle(["r1", "r2", "r3", "r4"])  # a fourth joins: it takes its share
    joined = {run: owners(replicas.held, run) for run in RUNS}
    for run, partitions in RUNS.items():
        moved = [p for p in range(partitions) if joined[run][p] != before[run][p]]
        assert all(joined[run][p] == "r4" for p in moved), run  # only to the newcomer
        assert len(moved) == partitions // 4, run
    replicas.held.pop("r2")  # r2 dies: only its partitions move, onto the others
    async with asyncio.timeout(30):
        while any(o.live for o in await catalog.partition_owners("alpha") if o.replica_id == "r2"):
            for replica in ("r1", "r3", "r4"):
                await replicas.tick(replica)
            await asyncio.sleep(0.2)
    await replicas.settle(["r1", "r3", "r4"])
    for run, partitions in RUNS.items():
        after = owners(replicas.held, run)
        moved = {p for p in range(partitions) if after[p] != joined[run][p]}
        assert moved == {p for p in range(partitions) if joined[run][p] == "r2"}, run
        counts = [sum(1 for o in after.values() if o == r) for r in ("r1", "r3", "r4")]
        assert max(counts) - min(counts) <= 1, (run, counts)


async def test_the_heartbeat_writes_the_replica_report_every_replica_reads(
    catalog: Catalog,
) -> None:
    report = '{"runs": {"alpha": {"status": "ok"}}, "age_s": 0.5}'
    await catalog.lease_tick("r1", lease_s=LONG, held={}, fresh=True, health=report)
    await catalog.lease_tick("r2", lease_s=LONG, held={}, fresh=True)
    view = await catalog.cluster_view("alpha")
    assert view.partitions == {"alpha": 8}
    assert {owner for owner, _ in view.leases["alpha"].values()} == {"r1"}
    first = view.replicas["r1"]
    assert first.live and first.silent_s < 30
    assert first.health == {"runs": {"alpha": {"status": "ok"}}, "age_s": 0.5}
    assert view.replicas["r2"].health is None  # it wrote none
    everything = await catalog.cluster_view()
    assert set(everything.partitions) == set(RUNS) and set(everything.leases) == set(RUNS)
    await catalog.release_leases("r2")
    assert "r2" not in (await catalog.cluster_view()).replicas  # gone, owns nothing
