"""Replicas fold only the partitions they own: ``Log.follow_run`` on a subset, two
coordinators on one log and one catalog with disjoint owned sets, and a projector started afresh
when its replica's owned partitions change; on the embedded log with SQLite and on Kafka with
PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.catalog import Catalog, open_catalog
from rolloutlog.catalog._registry import backend_for
from rolloutlog.errors import BackendUnavailable
from rolloutlog.log import Log, open_log, partition_for
from rolloutlog.projections import Coordinator
from rolloutlog.projections._ownership import Ownership
from tests import factories as f

RUN = "run"
P = 4
EPISODES = [f"r{i}" for i in range(24)]
LONG = 60.0  # leases that do not lapse during a test: the tests tick by hand


class Cluster:
    """Replicas (coordinators) over one log and one catalog, started and stopped together."""

    def __init__(self, stack: AsyncExitStack, data_dir: Path, deployment: dict[str, Any]):
        self.stack = stack
        self.log_url = deployment.get("log_url") or f"embedded://{data_dir}"
        self.catalog_url = (
            deployment.get("catalog_url") or f"sqlite+aiosqlite:///{data_dir}/catalog.sqlite3"
        )
        self.shared_log: Log | None = None

    async def log(self) -> Log:
        if self.log_url.startswith("embedded://"):  # one process holds the data directory
            if self.shared_log is None:
                self.shared_log = await self.stack.enter_async_context(open_log(self.log_url))
            return self.shared_log
        return await self.stack.enter_async_context(open_log(self.log_url))

    async def replica(self, name: str) -> Coordinator:
        catalog = await self.stack.enter_async_context(open_catalog(self.catalog_url))
        coordinator = Coordinator(await self.log(), catalog, replica_id=name, lease_s=LONG)
        await coordinator.start()
        self.stack.push_async_callback(coordinator.stop)
        return coordinator


@pytest.fixture
async def cluster(tmp_path: Path, deployment: dict[str, Any]) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        yield Cluster(stack, tmp_path, deployment)


async def settle(*replicas: Coordinator, run: str = RUN) -> None:
    """Tick every replica until a round changes nothing, then wait until the run's projector of
    each folds exactly what its replica owns and has caught up (other tests of several replicas
    in one process use it too: real leases, ticked by hand)."""
    for _ in range(6):
        before = [r.owned_partitions(run) for r in replicas]
        for replica in replicas:
            await replica._ownership.tick()
        if before == [r.owned_partitions(run) for r in replicas]:
            break
    async with asyncio.timeout(30):
        for replica in replicas:
            while True:
                projector = replica.projectors.get(run)
                owned = replica.owned_partitions(run)
                if (
                    projector is not None
                    and projector.owned == frozenset(owned)
                    and projector.generations == owned
                    and projector.caught_up
                ):
                    break
                await asyncio.sleep(0.02)


async def folded(replica: Coordinator) -> set[str]:
    """The episodes the replica's projector tracks once it applied the whole log."""
    projector = await replica.projector(RUN)
    ends = await replica.log.latest_offsets(RUN)
    await projector.wait_until(dict(enumerate(ends)), timeout_s=30)
    return {tracked.episode for tracked in replica.tracked_episodes(RUN)}


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    async with asyncio.timeout(10):
        while True:
            if text in caplog.text:
                return
            await asyncio.sleep(0.02)


def home(episodes: list[str], partitions: set[int]) -> set[str]:
    return {e for e in episodes if partition_for(e, P) in partitions}


async def test_follow_run_follows_only_the_partitions_asked_for(cluster: Cluster) -> None:
    log = await cluster.log()
    await log.ensure_run(RUN, P)
    positions = await log.append(RUN, [f.started(e) for e in EPISODES])
    wanted = {0, 2}
    expected = {(p.partition, p.offset) for p in positions if p.partition in wanted}
    seen: set[tuple[int, int]] = set()
    pages = log.follow_run(RUN, [0] * P, partitions=wanted)
    async with asyncio.timeout(30):
        async for partition, page in pages:
            seen.update((partition, offset) for offset, _ in page)
            if seen >= expected:
                break
    await pages.aclose()
    assert seen == expected


async def test_two_replicas_each_fold_only_the_partitions_they_own(cluster: Cluster) -> None:
    a = await cluster.replica("a")
    b = await cluster.replica("b")
    await a.create_run(RUN, P)
    await settle(a, b)
    owned_a, owned_b = set(a.owned_partitions(RUN)), set(b.owned_partitions(RUN))
    assert owned_a and owned_b
    assert owned_a.isdisjoint(owned_b) and owned_a | owned_b == set(range(P))
    await a.log.append(RUN, [f.started(e) for e in EPISODES])
    await b.log.append(RUN, [f.step_started(e) for e in EPISODES])
    assert await folded(a) == home(EPISODES, owned_a)
    assert await folded(b) == home(EPISODES, owned_b)
    lags = await a.projector_lag(RUN)
    assert {partition for partition, _, _ in lags} == owned_a
    listed = await b.partition_owners(RUN)
    assert {o.partition: o.replica_id for o in listed} == {
        p: "a" if p in owned_a else "b" for p in range(P)
    }
    assert a.owned_partition_counts() == {RUN: len(owned_a)}


async def test_an_owner_change_starts_the_projector_afresh_from_the_log(
    cluster: Cluster,
) -> None:
    a = await cluster.replica("a")
    await a.create_run(RUN, P)
    assert a.owned_partitions(RUN) == dict.fromkeys(range(P), 1)  # owned as soon as created
    await a.log.append(RUN, [f.started(e) for e in EPISODES])
    assert await folded(a) == set(EPISODES)
    first = a.projectors[RUN]

    b = await cluster.replica("b")
    await settle(a, b)
    shrunk = a.projectors[RUN]
    assert shrunk is not first and first.owned == frozenset(range(P))
    kept = set(a.owned_partitions(RUN))
    assert kept < set(range(P))
    assert await folded(a) == home(EPISODES, kept)  # rebuilt from the log for its partitions
    assert await folded(b) == home(EPISODES, set(range(P)) - kept)

    await b.stop()  # releases its partitions: a takes them at its next tick, no lease to wait
    await settle(a)
    assert set(a.owned_partitions(RUN)) == set(range(P))
    # a released them (2), b claimed (3) and released them (4), a claimed them again (5).
    assert a.owned_partitions(RUN) == {p: 1 if p in kept else 5 for p in range(P)}
    assert await folded(a) == set(EPISODES)


class _CutOff(Catalog):
    """The heartbeat's catalog, unreachable while ``cut`` is set (set from the test's loop)."""

    cut = threading.Event()

    async def lease_tick(self, *args: Any, **kwargs: Any) -> dict[str, dict[int, int]]:
        if self.cut.is_set():
            raise BackendUnavailable("the catalog is unreachable (cut off by the test)")
        return await super().lease_tick(*args, **kwargs)


async def test_a_replica_cut_off_from_the_catalog_keeps_folding_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rolloutlog.projections._ownership")
    url = f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"
    async with open_catalog(url) as catalog:
        await catalog.create_run(RUN, partitions=P)
        ownership = Ownership(
            catalog,
            "a",
            lease_s=0.2,
            heartbeat_catalog=lambda: _CutOff(backend_for(url), abort_pending_on_start=False),
        )
        await ownership.start()
        owned = ownership.owned
        assert owned == {RUN: dict.fromkeys(range(P), 1)}
        _CutOff.cut.set()  # every tick fails from now on
        try:
            await logged(caplog, "ran out")
            assert "could not renew its partition leases" in caplog.text
            assert ownership.owned is owned  # it keeps what it had (its writes are fenced)
        finally:
            _CutOff.cut.clear()
        await logged(caplog, "renewed its partition leases after")
        assert ownership.owned == owned  # nobody else claimed them meanwhile
        await ownership.stop()
        await ownership.release()
        assert {o.replica_id for o in await catalog.partition_owners(RUN)} == {None}


async def test_the_heartbeat_renews_while_the_service_loop_is_blocked(tmp_path: Path) -> None:
    """The lease tick has a thread of its own: a loop blocked past the lease loses nothing."""
    async with open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}") as catalog:
        await catalog.create_run(RUN, partitions=P)
        ownership = Ownership(catalog, "a", lease_s=0.4)
        await ownership.start()
        ownership.publish({"runs": {}})
        time.sleep(1.6)  # noqa: ASYNC251 -- blocking this loop is the point: four leases
        listed = await catalog.partition_owners(RUN)
        assert all(o.replica_id == "a" and o.live and o.generation == 1 for o in listed)
        view = await catalog.cluster_view(RUN)
        report = view.replicas["a"].health
        assert report is not None and report["age_s"] > 1.0  # the loop's report went stale
        await ownership.release()


async def test_two_processes_under_one_replica_id_are_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_catalog(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}") as catalog:
        await catalog.create_run(RUN, partitions=P)
        first, second = Ownership(catalog, "same"), Ownership(catalog, "same")
        await first.tick()
        await second.tick()  # takes "its" partitions from before a restart, one generation on
        assert "another live process uses the same replica id" not in caplog.text
        await first.tick()
        assert "another live process uses the same replica id" in caplog.text
        await first.release()
        await second.release()
