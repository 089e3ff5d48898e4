"""Restores planned per partition owner (issue 17): two coordinators in one process, with disjoint
owned partitions of one run over one log and catalog (their leases written directly), plan a
restore together: requested at either, it commits the plan one owner of every partition would
commit, and both projectors apply its resets. A part that never comes aborts the request at its
deadline (the old attempts stay current); a request whose requester died is swept, and a projector
started meanwhile waits for its verdict."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rolloutlog.catalog import RestoreEntry
from rolloutlog.errors import BackendUnavailable
from rolloutlog.log import partition_for
from rolloutlog.projections import Coordinator
from rolloutlog.projections._planner import RestorePolicy
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._restorer import PlanRequest
from tests import factories as f
from tests.contract.test_restore_parts import set_leases
from tests.projections.conftest import Service, open_service

#: Replica "local" (the service's coordinator) owns partitions 0 and 1, "r2" owns 2 and 3.
OWNERS = {0: "local", 1: "local", 2: "r2", 3: "r2"}
#: One of each kind per owner: a (p0), d (p1), c (p2), f (p3) continue; b (p0), e (p2) restart;
#: k (p0), g (p3) finished; h (p1), i (p2), j (p2) begin after the markers.
EXCLUDE = ["a", "j", "e"]


def owned_by(replica: str) -> frozenset[int]:
    return frozenset(p for p, owner in OWNERS.items() if owner == replica)


async def scenario(data_dir: Path) -> tuple[Service, int]:
    """A run with every kind of episode in every partition, checkpointed; returns its id."""
    service = await open_service(data_dir)
    for episode in ("a", "c"):
        await service.append(f.started(episode), f.boundary(episode, "seed", {"turn": 1}))
    for episode in ("d", "f"):
        await service.append(
            f.started(episode),
            f.ledger_row(episode, "c1", [1, 2, 3]),
            f.boundary(episode, "seed", {"turn": 1}),
            f.chunk(episode, "c2", 0, 8),
        )
    for episode in ("b", "e"):
        await service.append(
            f.started(episode),
            f.session_started(episode, "s1", "restart_only"),
            f.boundary(episode),
        )
    for episode in ("k", "g"):
        await service.append(f.started(episode), f.boundary(episode), f.finished(episode))
    result = await service.checkpoint()
    await service.append(f.boundary("c", "invoke_agent", {"turn": 2}))  # after the markers
    for episode in ("h", "i", "j"):
        await service.append(f.started(episode))
    return service, result.checkpoint.checkpoint_id


def catalog_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{data_dir}/catalog.sqlite3"


async def split(service: Service, *others: Coordinator) -> None:
    """Lease the run's partitions to their owners and make each projector fold its own."""
    await set_leases(
        catalog_url(service.data_dir), {p: (o, 1) for p, o in OWNERS.items()}, run="run"
    )
    for coordinator in (service.coordinator, *others):
        projector = coordinator.projectors["run"]
        projector.owned = owned_by(coordinator._restorer.replica_id)
        projector.generations = dict.fromkeys(projector.owned, 1)


@pytest.fixture
def replicas() -> list[Coordinator]:
    """Coordinators started over a service's log and catalog (``close`` stops them)."""
    return []


async def close(service: Service, replicas: list[Coordinator]) -> None:
    for coordinator in replicas:
        await coordinator.stop()
    await service.close()


async def replica(service: Service, started: list[Coordinator], replica_id: str) -> Projector:
    coordinator = Coordinator(service.log, service.catalog, replica_id=replica_id)
    started.append(coordinator)
    await coordinator.start()
    return await coordinator.projector("run")


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def check_resets(projector: Projector, entries: tuple[RestoreEntry, ...]) -> None:
    """The projector's trackers of its own episodes are at the attempts the restore made."""
    for entry in entries:
        if partition_for(entry.episode, projector.partitions) not in projector.owned:
            continue
        if entry.action == "excluded":
            assert entry.episode in projector.retired
        else:
            assert projector.trackers[entry.episode].attempt == entry.attempt, entry


@pytest.mark.parametrize("requester", ["local", "r2"])
async def test_a_restore_at_either_owner_commits_the_single_owner_plan(
    tmp_path: Path, replicas: list[Coordinator], requester: str
) -> None:
    single, _ = await scenario(tmp_path / "single")
    try:
        expected = await single.restore(exclude=EXCLUDE)
    finally:
        await single.close()
    service, _ = await scenario(tmp_path / "split")
    try:
        other = await replica(service, replicas, "r2")
        await split(service, replicas[0])
        mine = service.coordinator.projectors["run"]
        at = service.coordinator if requester == "local" else replicas[0]
        result = await at.restore("run", service.epoch, exclude=EXCLUDE)
        assert result.entries == expected.entries
        assert result.restore.counts == expected.restore.counts
        assert result.restore.counts == {"continue": 3, "restart": 3, "excluded": 3}
        restore_id = result.restore.restore_id
        assert (await service.catalog.get_restore_request("run", restore_id)).status == "committed"
        # The requester planned its partitions in-process; the other owner wrote its parts.
        parts = await service.catalog.restore_parts("run", restore_id)
        writer = "r2" if requester == "local" else "local"
        assert [(p.partition, p.replica_id) for p in parts] == [
            (p, writer) for p in sorted(owned_by(writer))
        ]
        await until(lambda: not mine.pending_restores and not other.pending_restores)
        check_resets(mine, result.entries)
        check_resets(other, result.entries)
        # Either replica serves the continued episodes' projections, the same.
        here = await service.coordinator.restore_projections("run", restore_id)
        there = await replicas[0].restore_projections("run", restore_id)
        assert sorted(here) == sorted(there) == ["c", "d", "f"]
        assert here["c"].boundaries == there["c"].boundaries
        assert here["c"].boundaries["environment"].state.value() == {"turn": 1}
        # The old attempts are fenced on both owners, the new ones count.
        await service.append(
            f.boundary("c", "zombie", {"turn": "old"}, attempt=0),
            f.boundary("d", "zombie", {"turn": "old"}, attempt=0),
            f.boundary("c", "invoke_agent", {"turn": 3}, attempt=1),
        )
        await asyncio.sleep(0.2)
        assert other.trackers["c"].attempt == mine.trackers["d"].attempt == 1
        current = await service.catalog.current_attempts("run")
        assert current == {"g": 0, "k": 0} | {e.episode: e.attempt for e in expected.entries}
    finally:
        await close(service, replicas)


async def test_a_missing_part_aborts_at_the_deadline_and_old_attempts_stay(
    tmp_path: Path,
) -> None:
    service, _ = await scenario(tmp_path)
    try:
        await split(service)  # nobody plans partitions 2 and 3
        service.coordinator._restorer.deadline_s = 0.5
        mine = service.coordinator.projectors["run"]
        with pytest.raises(BackendUnavailable, match=r"no plan part for partition\(s\) \[2, 3\]"):
            await service.restore(exclude=EXCLUDE)
        request = await service.catalog.get_restore_request("run", 1)
        assert request.status == "aborted"
        # By the requester giving up, or by a poller's sweep past the deadline: whichever first.
        assert request.reason is not None
        assert "[2, 3]" in request.reason or "deadline" in request.reason
        assert await service.catalog.list_restores("run") == []
        assert set((await service.catalog.current_attempts("run")).values()) == {0}
        assert not mine.pending_restores
        assert mine.trackers["a"].attempt == 0 and "a" not in mine.retired
        # The old attempt is still current; once one replica owns everything, a restore commits.
        await service.append(f.boundary("a", "invoke_agent", {"turn": 2}, attempt=0))
        mine.owned, mine.generations = frozenset(range(4)), {}
        second = await service.checkpoint()
        result = await service.restore()
        assert result.restore.restore_id == 2
        entry = next(e for e in result.entries if e.episode == "a")
        assert (entry.action, entry.previous_attempt, entry.attempt) == ("continue", 0, 1)
        projection = (await service.coordinator.restore_projections("run", 2))["a"]
        assert projection.boundaries["environment"].stage == "invoke_agent"
        assert second.checkpoint.checkpoint_id == result.restore.checkpoint_id
    finally:
        await service.close()


async def test_a_dead_requesters_request_is_swept_and_a_new_projector_awaits_it(
    tmp_path: Path, replicas: list[Coordinator]
) -> None:
    service, checkpoint_id = await scenario(tmp_path)
    try:
        other = await replica(service, replicas, "r2")
        await split(service, replicas[0])
        mine = service.coordinator.projectors["run"]
        request = PlanRequest(frozenset(EXCLUDE), False, RestorePolicy())
        # Opened by a replica that dies at once: both owners plan their parts all the same.
        restore_id = await service.catalog.open_restore(
            "run",
            service.epoch,
            checkpoint_id,
            requested_by="r9",
            request=request.to_json(),
            deadline_s=1.5,
        )
        parts: list[int] = []

        async def all_parts() -> None:
            while len(parts) < 4:
                parts[:] = [p.partition for p in await service.catalog.restore_parts("run", 1)]
                await asyncio.sleep(0.02)

        await asyncio.wait_for(all_parts(), 5)
        assert restore_id in mine.pending_restores and restore_id in other.pending_restores
        # A projector started while the request plans treats its verdict as pending.
        late = await replica(service, replicas, "r3")
        assert restore_id in late.pending_restores
        await until(
            lambda: not (mine.pending_restores or other.pending_restores or late.pending_restores)
        )
        swept = await service.catalog.get_restore_request("run", restore_id)
        assert swept.status == "aborted"
        assert swept.reason is not None and "deadline" in swept.reason
        assert set((await service.catalog.current_attempts("run")).values()) == {0}
        assert mine.trackers["a"].attempt == other.trackers["c"].attempt == 0
    finally:
        await close(service, replicas)


async def test_a_restarted_requester_aborts_the_requests_it_left(
    tmp_path: Path, replicas: list[Coordinator]
) -> None:
    service, checkpoint_id = await scenario(tmp_path)
    try:
        # "local" opened a request and died before committing it; it starts again.
        restore_id = await service.catalog.open_restore(
            "run",
            service.epoch,
            checkpoint_id,
            requested_by="local",
            request=PlanRequest(frozenset(), False, RestorePolicy()).to_json(),
            deadline_s=60,
        )
        again = await replica(service, replicas, "local")
        await until(lambda: not again.pending_restores, timeout_s=5)
        ended = await service.catalog.get_restore_request("run", restore_id)
        assert (ended.status, ended.reason) == ("aborted", "its requester restarted")
        result = await replicas[0].restore("run", service.epoch)
        assert result.restore.restore_id == restore_id + 1
    finally:
        await close(service, replicas)
