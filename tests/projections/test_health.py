"""Health across replicas, judged from the catalog's leases and reports (``run_blockers``,
``summarize``): each state a partition can hold a run back in, without I/O. The same judgement on
real replicas is in tests/e2e/test_replica_health.py."""

from __future__ import annotations

from typing import Any

from rolloutlog.catalog import ClusterView, ReplicaReport
from rolloutlog.projections._health import run_blockers, summarize
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
