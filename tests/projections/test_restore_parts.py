"""Restores planned per partition owner: two coordinators in one process, with disjoint
owned partitions of one run over one log and catalog (the lease loop's, ticked by hand), plan a
restore together: requested at either, it commits the plan one owner of every partition would
commit, and both projectors apply its resets. A part that never comes aborts the request at its
deadline (the old attempts stay current); a request whose requester died is swept, and a projector
started meanwhile waits for its verdict."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rolloutlog.catalog import RestoreEntry
from rolloutlog.core._planner import RestorePolicy
from rolloutlog.errors import BackendUnavailable
from rolloutlog.log import partition_for
from rolloutlog.projections import Coordinator
from rolloutlog.projections._part_planner import PlanRequest
from rolloutlog.projections._projector import Projector
from tests import factories as f
from tests.projections.conftest import Service, open_service

#: Episodes of every kind in every partition: a (p0), d (p1), c (p2), f (p3) continue; b (p0), e
#: (p2) restart; k (p0), g (p3) finished; h (p1), i (p2), j (p2) begin after the markers.
EXCLUDE = ["a", "j", "e"]
LONG = 60.0  # leases that do not lapse during a test: replicas tick by hand (``settle``)


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


@pytest.fixture
def replicas() -> list[Coordinator]:
    """Coordinators started over a service's log and catalog (``close`` stops them)."""
    return []


async def close(service: Service, replicas: list[Coordinator]) -> None:
    for coordinator in replicas:
        await coordinator.stop()
    await service.close()


async def replica(service: Service, started: list[Coordinator], replica_id: str) -> Coordinator:
    """Another replica over the service's log and catalog, its partitions settled."""
    coordinator = Coordinator(service.log, service.catalog, replica_id=replica_id, lease_s=LONG)
    started.append(coordinator)
    await coordinator.start()
    await settle(service.coordinator, *started)
    return coordinator


async def settle(*replicas: Coordinator) -> None:
    """Tick every replica until a round changes nothing, then wait until each projector folds
    what its replica owns and has caught up."""
    for _ in range(6):
        before = [r.owned_partitions("run") for r in replicas]
        for coordinator in replicas:
            await coordinator._ownership.tick()
        if before == [r.owned_partitions("run") for r in replicas]:
            break

    def settled() -> bool:
        for coordinator in replicas:
            projector = coordinator.projectors.get("run")
            owned = coordinator.owned_partitions("run")
            if not (
                projector is not None
                and projector.owned == frozenset(owned)
                and projector.caught_up
            ):
                return False
        return True

    await until(settled)


def projector(coordinator: Coordinator) -> Projector:
    return coordinator.projectors["run"]


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


@pytest.mark.parametrize("at", ["first", "second"])
async def test_a_restore_at_either_owner_commits_the_single_owner_plan(
    tmp_path: Path, replicas: list[Coordinator], at: str
) -> None:
    single, _ = await scenario(tmp_path / "single")
    try:
        expected = await single.restore(exclude=EXCLUDE)
    finally:
        await single.close()
    service, _ = await scenario(tmp_path / "split")
    try:
        first, second = service.coordinator, await replica(service, replicas, "r2")
        owned = {c.replica_id: set(c.owned_partitions("run")) for c in (first, second)}
        assert owned[first.replica_id] and owned["r2"]
        assert owned[first.replica_id] | owned["r2"] == {0, 1, 2, 3}
        requester, writer = (first, second) if at == "first" else (second, first)
        result = await requester.restore("run", service.epoch, exclude=EXCLUDE)
        assert result.entries == expected.entries
        assert result.restore.counts == expected.restore.counts
        assert result.restore.counts == {"continue": 3, "restart": 3, "excluded": 3}
        restore_id = result.restore.restore_id
        assert (await service.catalog.get_restore_request("run", restore_id)).status == "committed"
        # The requester planned its partitions in-process; the other owner wrote its parts.
        parts = await service.catalog.restore_parts("run", restore_id)
        assert [(p.partition, p.replica_id) for p in parts] == [
            (p, writer.replica_id) for p in sorted(owned[writer.replica_id])
        ]
        assert [p.generation for p in parts] == [
            writer.owned_partitions("run")[p.partition] for p in parts
        ]
        await until(
            lambda: not projector(first).pending_restores and not projector(second).pending_restores
        )
        check_resets(projector(first), result.entries)
        check_resets(projector(second), result.entries)
        # Either replica serves the continued episodes' projections, the same.
        here = await first.restore_projections("run", restore_id)
        there = await second.restore_projections("run", restore_id)
        assert sorted(here) == sorted(there) == ["c", "d", "f"]
        assert here["c"].boundaries == there["c"].boundaries
        assert here["c"].boundaries["environment"].state.value() == {"turn": 1}
        # The old attempts are fenced by their owners, the new ones count.
        await service.append(
            f.boundary("c", "zombie", {"turn": "old"}, attempt=0),
            f.boundary("d", "zombie", {"turn": "old"}, attempt=0),
            f.boundary("c", "invoke_agent", {"turn": 3}, attempt=1),
        )
        await asyncio.sleep(0.2)
        for episode in ("c", "d"):
            owner = first if partition_for(episode, 4) in owned[first.replica_id] else second
            assert projector(owner).trackers[episode].attempt == 1
        current = await service.catalog.current_attempts("run")
        assert current == {"g": 0, "k": 0} | {e.episode: e.attempt for e in expected.entries}
    finally:
        await close(service, replicas)


async def test_a_missing_part_aborts_at_the_deadline_and_old_attempts_stay(
    tmp_path: Path, replicas: list[Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = await scenario(tmp_path)
    try:
        silent = Coordinator(service.log, service.catalog, replica_id="r2", lease_s=LONG)

        async def never() -> None:  # a replica that holds its leases but plans nothing
            await asyncio.Event().wait()

        monkeypatch.setattr(silent._restorer, "poll", never)
        replicas.append(silent)
        await silent.start()
        await settle(service.coordinator, silent)
        theirs = sorted(silent.owned_partitions("run"))
        assert theirs
        service.coordinator._restorer.deadline_s = 0.5
        with pytest.raises(BackendUnavailable, match=re.escape(f"partition(s) {theirs} within")):
            await service.restore(exclude=EXCLUDE)
        request = await service.catalog.get_restore_request("run", 1)
        assert request.status == "aborted"
        # By the requester giving up, or by a poller's sweep past the deadline: whichever first.
        assert request.reason is not None
        assert str(theirs) in request.reason or "deadline" in request.reason
        assert await service.catalog.list_restores("run") == []
        assert set((await service.catalog.current_attempts("run")).values()) == {0}
        mine = projector(service.coordinator)
        assert not mine.pending_restores
        # The old attempts are still current; once the silent replica is gone, a restore commits.
        await service.append(f.boundary("a", "invoke_agent", {"turn": 2}, attempt=0))
        replicas.remove(silent)
        await silent.stop()
        await settle(service.coordinator)
        assert set(service.coordinator.owned_partitions("run")) == {0, 1, 2, 3}
        second = await service.checkpoint()
        result = await service.restore()
        assert result.restore.restore_id == 2
        assert second.checkpoint.checkpoint_id == result.restore.checkpoint_id
        entry = next(e for e in result.entries if e.episode == "a")
        assert (entry.action, entry.previous_attempt, entry.attempt) == ("continue", 0, 1)
        projection = (await service.coordinator.restore_projections("run", 2))["a"]
        assert projection.boundaries["environment"].stage == "invoke_agent"
        # A lone owner writes no parts.
        assert await service.catalog.restore_parts("run", 2) == []
    finally:
        await close(service, replicas)


async def test_a_dead_requesters_request_is_swept_and_a_new_projector_awaits_it(
    tmp_path: Path, replicas: list[Coordinator]
) -> None:
    service, checkpoint_id = await scenario(tmp_path)
    try:
        await replica(service, replicas, "r2")
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
        everyone = [service.coordinator, replicas[0]]
        assert all(restore_id in projector(c).pending_restores for c in everyone)
        # A projector started while the request plans treats its verdict as pending.
        late = Coordinator(service.log, service.catalog, replica_id="r3", lease_s=LONG)
        replicas.append(late)
        await late.start()
        await late.projector("run")
        assert restore_id in projector(late).pending_restores
        everyone.append(late)
        await until(lambda: not any(projector(c).pending_restores for c in everyone))
        swept = await service.catalog.get_restore_request("run", restore_id)
        assert swept.status == "aborted"
        assert swept.reason is not None and "deadline" in swept.reason
        assert set((await service.catalog.current_attempts("run")).values()) == {0}
        for coordinator in everyone:
            assert all(t.attempt == 0 for t in projector(coordinator).trackers.values())
    finally:
        await close(service, replicas)


async def test_a_restarted_requester_aborts_the_requests_it_left(
    tmp_path: Path, replicas: list[Coordinator]
) -> None:
    service, checkpoint_id = await scenario(tmp_path)
    try:
        # Replica r5 opened a request and died before committing it; it starts again.
        restore_id = await service.catalog.open_restore(
            "run",
            service.epoch,
            checkpoint_id,
            requested_by="r5",
            request=PlanRequest(frozenset(), False, RestorePolicy()).to_json(),
            deadline_s=60,
        )
        again = await replica(service, replicas, "r5")
        await until(lambda: not projector(again).pending_restores, timeout_s=5)
        ended = await service.catalog.get_restore_request("run", restore_id)
        assert (ended.status, ended.reason) == ("aborted", "its requester restarted")
        result = await again.restore("run", service.epoch)
        assert result.restore.restore_id == restore_id + 1
    finally:
        await close(service, replicas)


async def test_a_requester_that_gains_partitions_mid_request_plans_them(
    tmp_path: Path, replicas: list[Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = await scenario(tmp_path)
    try:
        silent = Coordinator(service.log, service.catalog, replica_id="r2", lease_s=LONG)

        async def never() -> None:  # an owner that plans nothing, then leaves
            await asyncio.Event().wait()

        monkeypatch.setattr(silent._restorer, "poll", never)
        replicas.append(silent)
        await silent.start()
        await settle(service.coordinator, silent)
        theirs = sorted(silent.owned_partitions("run"))
        request = asyncio.create_task(service.restore(exclude=EXCLUDE))
        await until(lambda: bool(service.coordinator._restorer._requesting))
        # The silent owner goes; the requester takes its partitions over (its run's projector
        # starts afresh while the request waits for their parts) and plans them after all.
        replicas.remove(silent)
        await silent.stop()
        await settle(service.coordinator)
        result = await asyncio.wait_for(request, 20)
        assert result.restore.counts == {"continue": 3, "restart": 3, "excluded": 3}
        parts = await service.catalog.restore_parts("run", result.restore.restore_id)
        # (Its new projector wrote a part of every partition it owns: the requester took those
        # it had planned itself from memory.)
        assert {p.partition for p in parts} >= set(theirs)
        assert {p.replica_id for p in parts} == {service.coordinator.replica_id}
        mine = projector(service.coordinator)
        await until(lambda: not mine.pending_restores)
        check_resets(mine, result.entries)
    finally:
        await close(service, replicas)
