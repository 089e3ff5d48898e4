"""Health across replicas: which partition and which replica hold a run back, on any replica.

Every replica publishes a report of its projectors (``replica_report``: per run its projector's
health, and per partition it folds the lease generation and, while it is not ``ok``, how far it
trails the log); its heartbeat writes the report into the catalog's
``replicas`` row with the report's age (``Ownership.publish``). Any replica reads every row with
the leases (``Catalog.cluster_view``) and judges each partition of a run (``run_blockers``):

- ``unowned``: no replica holds it (between a release and the next owner's claim);
- ``lease_expired``: its owner stopped renewing and nobody claimed it yet;
- ``unresponsive``: its owner renews (the heartbeat has a thread of its own) but its event loop
  has not refreshed its report for over half a lease, or its heartbeat is late;
- ``starting``: its owner holds the lease but folds it not yet (at that generation);
- ``catching_up``, ``degraded``, ``stopped``: its owner's projector for the run says so.

The asking replica judges its own partitions from its live report, never from the catalog's copy.
A run projector's own health (``RunHealth``: ``ok``, ``degraded``, ``stopped``, which the
projector sets) is ``_run_health``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rolloutlog.catalog import ClusterView, ReplicaReport
from rolloutlog.log import Log
from rolloutlog.projections._run_health import STARTING, HealthStatus, RunHealth

if TYPE_CHECKING:  # the projector reports its health with these: no import back at run time
    from rolloutlog.projections._projector import Projector

logger = logging.getLogger(__name__)

__all__ = [
    "STARTING",
    "Blocker",
    "HealthReporter",
    "HealthStatus",
    "RunHealth",
    "RunHealthReport",
    "own_blockers",
    "replica_report",
    "run_blockers",
]

BlockerState = Literal[
    "unowned",
    "lease_expired",
    "unresponsive",
    "starting",
    "catching_up",
    "degraded",
    "stopped",
]
#: How long a lagging projector's report waits for the log's end offsets.
_ENDS_WAIT_S = 1.0
#: Statuses by severity: the run's status is its worst partition's.
_SEVERITY = {"ok": 0, "degraded": 1, "stopped": 2}


@dataclass(frozen=True, slots=True)
class Blocker:
    """One partition that holds a run back, with the replica that holds it (None: nobody)."""

    partition: int
    replica: str | None
    state: BlockerState
    reason: str
    #: Since when (unix time, the owner's clock) the state holds, when known.
    since: float | None = None
    #: Records of the partition its owner has not applied yet, when known.
    lag: int | None = None

    @property
    def status(self) -> Literal["degraded", "stopped"]:
        """What the blocker makes of the run: ``stopped`` needs an operator; else it heals."""
        return "stopped" if self.state == "stopped" else "degraded"

    def view(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "replica": self.replica,
            "state": self.state,
            "reason": self.reason,
            "since": self.since,
            "lag": self.lag,
        }


@dataclass(frozen=True, slots=True)
class RunHealthReport:
    """A run's health as every replica reports it (``GET /v1/runs/{run}``, ``/readyz``)."""

    #: The run's status across replicas: ``ok`` when no partition holds it back.
    status: Literal["ok", "degraded", "stopped"]
    error: str | None
    since: float | None
    held_back: tuple[Blocker, ...]
    #: This replica's own projector of the run ({"status", "error", "since"}), or None.
    local: Mapping[str, Any] | None
    #: Why the other replicas' reports are missing (the catalog could not be read), or None.
    unknown: str | None = None

    def view(self, replica_id: str) -> dict[str, Any]:
        return {
            "status": self.status,
            "error": self.error,
            "since": self.since,
            "replica": replica_id,
            "local": dict(self.local) if self.local is not None else None,
            "held_back": [blocker.view() for blocker in self.held_back],
            "cluster_unknown": self.unknown,
        }


def replica_report(
    projectors: Iterable[Projector], ends: Mapping[str, list[int]] | None = None
) -> dict[str, Any]:
    """This replica's report: per run its projector's health and, per partition it folds, its
    ``[generation, lag]`` (lag from ``ends``, the log's end offsets, where given; else null)."""
    runs: dict[str, Any] = {}
    for projector in projectors:
        health = projector.health
        run_ends = (ends or {}).get(projector.run)
        partitions: dict[str, list[int | None]] = {}
        for partition in sorted(projector.owned):
            lag = None
            if run_ends is not None and partition < min(len(run_ends), len(projector.applied)):
                lag = max(0, run_ends[partition] - projector.applied[partition])
            partitions[str(partition)] = [projector.generations.get(partition, 0), lag]
        runs[projector.run] = {
            "status": health.status,
            "error": health.error,
            "since": health.since,
            "caught_up": projector.caught_up,
            "partitions": partitions,
        }
    return {"runs": runs}


def run_blockers(
    run: str,
    view: ClusterView,
    replica_id: str,
    local: Mapping[str, Any],
    lease_s: float,
) -> list[Blocker]:
    """The partitions of ``run`` that hold it back (see the module), judged from ``view`` and,
    for this replica's own partitions, from its live report ``local``."""
    leases = view.leases.get(run, {})
    blockers: list[Blocker] = []
    for partition in range(view.partitions.get(run, 0)):
        owner, generation = leases.get(partition, (None, 0))
        if owner is None:
            reason = "no replica owns it yet" if generation == 0 else "changing hands"
            blockers.append(Blocker(partition, None, "unowned", reason))
            continue
        found = _judge(run, partition, owner, generation, view, replica_id, local, lease_s)
        if found is not None:
            blockers.append(found)
    return blockers


def own_blockers(
    run: str, replica_id: str, local: Mapping[str, Any], lease_s: float
) -> list[Blocker]:
    """The partitions of ``run`` this replica folds that hold it back, from its live report
    alone (when the catalog cannot say who owns the others)."""
    run_report = local.get("runs", {}).get(run)
    if run_report is None:
        return []
    leases = {
        int(p): (replica_id, int(folded[0])) for p, folded in run_report["partitions"].items()
    }
    view = ClusterView({run: 0}, {run: leases}, {})
    found = (
        _judge(run, p, replica_id, generation, view, replica_id, local, lease_s)
        for p, (_, generation) in sorted(leases.items())
    )
    return [blocker for blocker in found if blocker is not None]


def _judge(
    run: str,
    partition: int,
    owner: str,
    generation: int,
    view: ClusterView,
    replica_id: str,
    local: Mapping[str, Any],
    lease_s: float,
) -> Blocker | None:
    report: Mapping[str, Any] | None
    if owner == replica_id:
        report = local
    else:
        replica: ReplicaReport | None = view.replicas.get(owner)
        if replica is None or not replica.live:
            silent = f" {replica.silent_s:.1f} s ago" if replica is not None else ""
            reason = (
                f"replica {owner} stopped renewing its lease{silent}; "
                "another replica takes the partition at its next heartbeat"
            )
            return Blocker(partition, owner, "lease_expired", reason)
        report = replica.health
        their_lease_s = float((report or {}).get("lease_s", lease_s))
        if replica.silent_s > their_lease_s / 2:
            reason = (
                f"replica {owner}'s heartbeat is late ({replica.silent_s:.1f} s since the last; "
                f"its lease runs out after {their_lease_s:g} s)"
            )
            return Blocker(partition, owner, "unresponsive", reason)
        if report is not None:
            quiet_s = float(report.get("age_s", 0.0)) + replica.silent_s
            if quiet_s > their_lease_s / 2:
                reason = (
                    f"replica {owner} is alive (its heartbeat is current) but its event loop "
                    f"has not answered for {quiet_s:.1f} s"
                )
                return Blocker(partition, owner, "unresponsive", reason)
    run_report = (report or {}).get("runs", {}).get(run) if report is not None else None
    folded = (run_report or {}).get("partitions", {}).get(str(partition))
    if run_report is None or folded is None or folded[0] != generation:
        reason = f"replica {owner} holds it (generation {generation}) but folds it not yet"
        return Blocker(partition, owner, "starting", reason)
    status = run_report.get("status")
    if status == "ok":
        return None
    error = run_report.get("error") or str(status)
    since = run_report.get("since")
    lag = folded[1] if len(folded) > 1 else None
    if status == "stopped":
        state: BlockerState = "stopped"
    elif not run_report.get("caught_up") and error == STARTING:
        state = "catching_up"
    else:
        state = "degraded"
    return Blocker(partition, owner, state, f"replica {owner}: {error}", since, lag)


def summarize(
    blockers: list[Blocker], local: Mapping[str, Any] | None, unknown: str | None = None
) -> RunHealthReport:
    """The run's health from its blockers (and this replica's own projector, ``local``)."""
    status: Literal["ok", "degraded", "stopped"] = "ok"
    for blocker in blockers:
        if _SEVERITY[blocker.status] > _SEVERITY[status]:
            status = blocker.status
    if local is not None and _SEVERITY.get(local["status"], 0) > _SEVERITY[status]:
        status = local["status"]
    error: str | None = None
    if local is not None and local["status"] != "ok":
        error = local["error"]
    elif blockers:
        first = blockers[0]
        more = f" (and {len(blockers) - 1} more partitions)" if len(blockers) > 1 else ""
        error = f"partition {first.partition}: {first.reason}{more}"
    if status == "ok":
        since = local["since"] if local is not None else None
    else:  # since when the oldest known trouble holds (unknown for a silent replica's)
        times = [b.since for b in blockers if b.since is not None]
        if local is not None and local["status"] != "ok":
            times.append(local["since"])
        since = min(times) if times else None
    return RunHealthReport(status, error, since, tuple(blockers), local, unknown)


class HealthReporter:
    """Publishes this replica's report every ``lease_s / 4`` (its heartbeat writes it) and
    answers for any run from every replica's report."""

    def __init__(
        self,
        log: Log,
        projectors: Mapping[str, Projector],
        cluster_view: Callable[[str | None], Awaitable[ClusterView]],
        publish: Callable[[Mapping[str, Any]], None],
        *,
        replica_id: str,
        lease_s: float,
    ) -> None:
        self._log = log
        self._projectors = projectors
        self._cluster_view = cluster_view
        self._publish = publish
        self.replica_id = replica_id
        self.lease_s = lease_s

    async def report(self) -> dict[str, Any]:
        """This replica's report now (the log's ends fetched, at once, for the projectors that
        are not ``ok``: their lag)."""
        projectors = list(self._projectors.values())
        lagging = [p.run for p in projectors if p.health.status != "ok"]
        found = await asyncio.gather(*(self._ends(run) for run in lagging))
        ends = {run: end for run, end in zip(lagging, found, strict=True) if end is not None}
        return replica_report(projectors, ends)

    async def _ends(self, run: str) -> list[int] | None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_ENDS_WAIT_S):
                return await self._log.latest_offsets(run)
        return None

    async def publish_forever(self) -> None:
        while True:
            try:
                self._publish(await self.report())
            except Exception:  # never let the report's trouble end the loop
                logger.exception("the replica's health report failed")
            await asyncio.sleep(self.lease_s / 4)

    async def runs(self, run: str | None = None) -> dict[str, RunHealthReport]:
        """Every run's health (``run``: that one) across replicas, judged now."""
        local = await self.report()
        try:
            view: ClusterView | None = await self._cluster_view(run)
            unknown = None
        except Exception as e:  # the catalog cannot answer: this replica's own view only
            view, unknown = None, f"the other replicas' reports are unreadable: {e}"
        names = set(local["runs"]) if run is None else {run}
        if view is not None and run is None:
            names |= set(view.partitions)
        out: dict[str, RunHealthReport] = {}
        for name in sorted(names):
            mine = local["runs"].get(name)
            own = (
                {"status": mine["status"], "error": mine["error"], "since": mine["since"]}
                if mine is not None
                else None
            )
            if view is not None:
                blockers = run_blockers(name, view, self.replica_id, local, self.lease_s)
            else:
                blockers = own_blockers(name, self.replica_id, local, self.lease_s)
            out[name] = summarize(blockers, own, unknown)
        return out
