"""Health across replicas, judged from the catalog's leases and reports (``run_blockers``,
``summarize``): each state a partition can hold a run back in, without I/O; then two coordinators
on Kafka and PostgreSQL, one unable to read the log. The same judgement on real replica
processes is in tests/e2e/test_replica_health.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest

from rolloutlog.catalog import ClusterView, ReplicaReport, open_catalog
from rolloutlog.log import open_log
from rolloutlog.projections import Coordinator
from rolloutlog.projections._health import own_blockers, run_blockers, summarize
from rolloutlog.projections._projector import STARTING

RUN = "run"
LEASE_S = 6.0


def report(status: str = "ok", error: str | None = None, **partitions: list[Any]) -> dict:
    """A replica's report of one run (partitions as ``p3=[generation, lag]``)."""
    return {
        "runs": {
            RUN: {
                "status": status,
                "error": error,
                "since": 100.0,
                "caught_up": error != STARTING,
                "partitions": {name[1:]: value for name, value in partitions.items()},
            }
        },
        "age_s": 0.2,
        "lease_s": LEASE_S,
    }


def view(
    leases: dict[int, tuple[str | None, int]], replicas: dict[str, ReplicaReport]
) -> ClusterView:
    return ClusterView({RUN: 4}, {RUN: leases}, replicas)


def replica(name: str, health: dict | None, *, live: bool = True, silent_s: float = 0.5):
    return ReplicaReport(name, None, live, silent_s, health)


def states(found: list[Any]) -> dict[int, tuple[str | None, str]]:
    return {b.partition: (b.replica, b.state) for b in found}


def test_every_partition_folded_and_ok_holds_nothing_back() -> None:
    mine = report(p0=[1, None], p1=[1, None])
    theirs = report(p2=[3, None], p3=[3, None])
    leases = {0: ("a", 1), 1: ("a", 1), 2: ("b", 3), 3: ("b", 3)}
    cluster = view(leases, {"a": replica("a", None), "b": replica("b", theirs)})
    assert run_blockers(RUN, cluster, "a", mine, LEASE_S) == []
    health = summarize([], {"status": "ok", "error": None, "since": 100.0})
    assert (health.status, health.error, health.since) == ("ok", None, 100.0)


def test_each_way_a_partition_holds_a_run_back() -> None:
    mine = report("degraded", STARTING, p0=[1, 700])
    leases = {0: ("a", 1), 1: ("b", 2), 2: ("c", 5), 3: (None, 4)}
    cluster = view(
        leases,
        {
            "a": replica("a", None),
            "b": replica("b", report("degraded", "KafkaConnectionError: down", p1=[2, 40])),
            "c": replica("c", report(p2=[4, None])),  # folds it at an older generation
        },
    )
    found = run_blockers(RUN, cluster, "a", mine, LEASE_S)
    assert states(found) == {
        0: ("a", "catching_up"),
        1: ("b", "degraded"),
        2: ("c", "starting"),
        3: (None, "unowned"),
    }
    assert [b.lag for b in found[:2]] == [700, 40]
    assert "KafkaConnectionError" in found[1].reason
    health = summarize(found, {"status": "degraded", "error": STARTING, "since": 90.0})
    assert (health.status, health.error, health.since) == ("degraded", STARTING, 90.0)


def test_a_silent_or_busy_or_dead_owner_is_named() -> None:
    leases = {0: ("busy", 1), 1: ("late", 1), 2: ("dead", 1), 3: ("gone", 1)}
    busy = report(p0=[1, None])
    busy["age_s"] = 4.0  # its loop has not refreshed the report for 4 s; heartbeat current
    cluster = view(
        leases,
        {
            "busy": replica("busy", busy),
            "late": replica("late", report(p1=[1, None]), silent_s=3.5),
            "dead": replica("dead", report(p2=[1, None]), live=False, silent_s=7.0),
        },
    )
    found = run_blockers(RUN, cluster, "me", {"runs": {}}, LEASE_S)
    assert states(found) == {
        0: ("busy", "unresponsive"),
        1: ("late", "unresponsive"),
        2: ("dead", "lease_expired"),
        3: ("gone", "lease_expired"),
    }
    assert "event loop has not answered for 4.5 s" in found[0].reason
    assert "heartbeat is late" in found[1].reason
    health = summarize(found, None)
    assert health.status == "degraded" and health.since is None
    assert health.error is not None and health.error.startswith("partition 0: replica busy")


def test_a_stopped_projector_stops_the_run() -> None:
    leases = {p: ("b", 1) for p in range(4)}
    lost = report("stopped", "the run's log lost records", **{f"p{p}": [1, None] for p in range(4)})
    found = run_blockers(RUN, view(leases, {"b": replica("b", lost)}), "a", {"runs": {}}, LEASE_S)
    assert {b.state for b in found} == {"stopped"}
    assert summarize(found, None).status == "stopped"


def test_without_the_catalog_a_replica_names_its_own_partitions_only() -> None:
    mine = report("degraded", "TimeoutError: the log", p1=[2, 12], p3=[2, None])
    found = own_blockers(RUN, "a", mine, LEASE_S)
    assert states(found) == {1: ("a", "degraded"), 3: ("a", "degraded")}
    assert own_blockers(RUN, "a", {"runs": {}}, LEASE_S) == []
    health = summarize(found, {"status": "degraded", "error": "x", "since": 1.0}, "no catalog")
    assert health.unknown == "no catalog" and health.status == "degraded"


@pytest.mark.kafka
@pytest.mark.postgres
async def test_a_replica_whose_projector_cannot_read_is_named_by_the_other(
    kafka_bootstrap: str, postgres_schema: str
) -> None:
    """Two replicas (coordinators with a Kafka client each) on one log and one catalog; b's
    reads of the log fail: a's view of the run names b's partitions ``degraded`` with b's error,
    from b's report in the catalog, while a's own projector stays ok."""
    log_url = f"kafka://{kafka_bootstrap}?topic_prefix=h{uuid.uuid4().hex[:10]}."

    async def failing(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise ConnectionError("the log is unreachable from this replica (injected)")
        yield  # an async generator, as the log's reads are

    async with AsyncExitStack() as stack:
        replicas = {}
        for name in ("a", "b"):
            log = await stack.enter_async_context(open_log(log_url))
            catalog = await stack.enter_async_context(open_catalog(postgres_schema))
            replica = Coordinator(log, catalog, replica_id=name, lease_s=60.0)
            await replica.start()
            stack.push_async_callback(replica.stop)
            replicas[name] = replica
        a, b = replicas["a"], replicas["b"]
        b.log.read_pages = failing  # type: ignore[method-assign]
        b.log.follow_run = failing  # type: ignore[method-assign]
        await a.create_run(RUN, 4)
        for _ in range(3):  # a lets b's share go, b claims it and starts its projector
            await a._ownership.tick()
            await b._ownership.tick()
        mine = set(b.owned_partitions(RUN))
        assert mine and mine.isdisjoint(a.owned_partitions(RUN))
        async with asyncio.timeout(30):
            while True:
                b._ownership.publish(await b.health_reporter.report())
                await b._ownership.tick()  # the heartbeat writes b's report
                health = (await a.runs_health(RUN))[RUN]
                if {x.partition for x in health.held_back if x.state == "degraded"} == mine:
                    break
                await asyncio.sleep(0.2)
        assert {x.replica for x in health.held_back} == {"b"}
        assert all("injected" in x.reason for x in health.held_back)
        assert health.status == "degraded" and health.local is not None
        assert health.local["status"] == "ok"  # a's own projector folds its partitions
