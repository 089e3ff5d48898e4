"""The service's Prometheus series (``prometheus_client``, one registry per app: a process may
run several services, as the tests do).

Counted where things happen: requests (``Observe``), appends, checkpoint and restore stages,
refusals. Read at scrape time from what the projectors already count: live episodes, applied
records, quarantined records, health, and per partition the log's end, the projector's applied
offset and the lag between them (the numbers ``GET /v1/runs/{run}/projector`` shows).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from rolloutlog.api._tokens import EVERY_RUN, RunScope
from rolloutlog.projections import CUT_DISPOSITIONS, ProjectionLine, served_cut_dispositions

if TYPE_CHECKING:
    from rolloutlog.projections import Coordinator

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "Metrics"]

logger = logging.getLogger("rolloutlog.api")

# ``_created`` series double every counter and histogram for a timestamp nobody graphs.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Latency buckets (seconds) from 0.5 ms to 60 s.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class _Projectors(Collector):
    """Series read from the coordinator at scrape time; the per-partition offsets come from the
    snapshot ``Metrics.refresh`` took just before (reading a log's end is async)."""

    def __init__(self, coordinator: Coordinator, inflight: Callable[[], int]) -> None:
        self.coordinator = coordinator
        self.inflight = inflight
        self.offsets: Mapping[str, list[tuple[int, int, int]]] = {}

    def collect(self) -> Iterator[Metric]:
        coordinator = self.coordinator
        live = GaugeMetricFamily(
            "rolloutlog_live_episodes",
            "Episodes the projector tracks that have not finished.",
            labels=["run"],
        )
        for run, count in sorted(coordinator.live_episode_counts().items()):
            live.add_metric([run], count)
        applied = CounterMetricFamily(
            "rolloutlog_projector_applied_records",
            "Log records the run's projector applied since the service started.",
            labels=["run"],
        )
        for run, count in sorted(coordinator.events_applied().items()):
            applied.add_metric([run], count)
        quarantined = CounterMetricFamily(
            "rolloutlog_quarantined_records",
            "Log records the projector skipped and quarantined since the service started.",
            labels=["run"],
        )
        for run, count in sorted(coordinator.quarantined_counts().items()):
            quarantined.add_metric([run], count)
        healthy = GaugeMetricFamily(
            "rolloutlog_run_healthy",
            "1 while the run's projector is ok, 0 while it is degraded or stopped.",
            labels=["run"],
        )
        for run, health in sorted(coordinator.health().items()):
            healthy.add_metric([run], 1.0 if health.status == "ok" else 0.0)
        end = GaugeMetricFamily(
            "rolloutlog_log_end_offset",
            "The log's end offset per run and partition (records appended).",
            labels=["run", "partition"],
        )
        offset = GaugeMetricFamily(
            "rolloutlog_projector_applied_offset",
            "The offset up to which the projector applied the partition.",
            labels=["run", "partition"],
        )
        lag = GaugeMetricFamily(
            "rolloutlog_projector_lag_records",
            "Records of the partition the projector has not applied yet.",
            labels=["run", "partition"],
        )
        for run, partitions in sorted(self.offsets.items()):
            for partition, log_end, done in partitions:
                labels = [run, str(partition)]
                end.add_metric(labels, log_end)
                offset.add_metric(labels, done)
                lag.add_metric(labels, log_end - done)
        inflight = GaugeMetricFamily(
            "rolloutlog_inflight_appends", "Append requests being processed."
        )
        inflight.add_metric([], self.inflight())
        owned = GaugeMetricFamily(
            "rolloutlog_owned_partitions",
            "Partitions of the run this replica owns (leases) and folds.",
            labels=["run"],
        )
        for run, count in sorted(coordinator.owned_partition_counts().items()):
            owned.add_metric([run], count)
        prepared = GaugeMetricFamily(
            "rolloutlog_prepared_projection_lines",
            "Lines of the run's newest committed checkpoint prepared for its restore, by the "
            "prepare's state (preparing, ready, skipped: over the budget, failed, cancelled).",
            labels=["run", "checkpoint_id", "state"],
        )
        for run, lines in sorted(coordinator.preparer.status().items()):
            prepared.add_metric([run, str(lines.checkpoint_id), lines.state], len(lines.lines))
        yield from (
            live,
            applied,
            quarantined,
            healthy,
            end,
            offset,
            lag,
            inflight,
            owned,
            prepared,
        )


class Metrics:
    """The service's series, in its own ``CollectorRegistry``."""

    def __init__(self, coordinator: Coordinator, inflight: Callable[[], int]) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.http_duration = Histogram(
            "rolloutlog_http_request_duration_seconds",
            "HTTP requests by method, route template and status.",
            ("method", "route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.appends = Counter(
            "rolloutlog_appends", "Append requests that succeeded.", registry=registry
        )
        self.events = Counter(
            "rolloutlog_append_events", "Events appended over HTTP.", registry=registry
        )
        self.bytes = Counter(
            "rolloutlog_append_bytes", "Request bytes of appends.", registry=registry
        )
        self.append_latency = Histogram(
            "rolloutlog_append_latency_seconds",
            "Time to validate, fence and durably append one request.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.checkpoint_duration = Histogram(
            "rolloutlog_checkpoint_duration_seconds",
            "Checkpoint durations by stage and outcome.",
            ("stage", "outcome"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.restore_duration = Histogram(
            "rolloutlog_restore_duration_seconds",
            "Restore durations by stage and outcome.",
            ("stage", "outcome"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.refusals = Counter(
            "rolloutlog_refusals", "Requests refused, by error code.", ("code",), registry=registry
        )
        self.generation_cuts = Counter(
            "rolloutlog_generation_cuts",
            "Generation cuts of the episodes restores planned, by what became of them.",
            ("disposition",),
            registry=registry,
        )
        for disposition in CUT_DISPOSITIONS:  # each a series from the start, 0 until one comes
            self.generation_cuts.labels(disposition)
        self._projectors = _Projectors(coordinator, inflight)
        registry.register(self._projectors)
        self._coordinator = coordinator
        # One HTTP handler per (method, route, status): ``labels()`` costs a lock and a dict
        # lookup, kept off the request path after the first request of each.
        self._http: dict[tuple[str, str, int], Any] = {}
        #: Restores whose continued cuts were counted (``count_served_cuts``).
        self._served: set[tuple[str, int]] = set()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        child = self._http.get(key)
        if child is None:
            child = self._http[key] = self.http_duration.labels(method, route, str(status))
        child.observe(seconds)

    def stages(self, histogram: Histogram, timings_ms: Mapping[str, float], outcome: str) -> None:
        for stage, ms in timings_ms.items():
            histogram.labels(stage, outcome).observe(ms / 1000.0)

    def count_cuts(self, dispositions: Mapping[str, int]) -> None:
        for disposition, count in dispositions.items():
            self.generation_cuts.labels(disposition).inc(count)

    def count_served_cuts(self, run: str, restore_id: int, lines: Iterable[ProjectionLine]) -> None:
        """The cuts a restore continues, counted once its projections were first all read."""
        self._count_served_once(run, restore_id, served_cut_dispositions(lines))

    def _count_served_once(self, run: str, restore_id: int, counts: Mapping[str, int]) -> None:
        if (run, restore_id) not in self._served:
            self._served.add((run, restore_id))
            self.count_cuts(counts)

    async def refresh(self) -> None:
        """Read every running projector's per-partition offsets (``projector_lag``)."""
        coordinator = self._coordinator
        runs = sorted(coordinator.events_applied())

        async def one(run: str) -> tuple[str, list[tuple[int, int, int]]] | None:
            try:
                return run, await coordinator.projector_lag(run)
            except Exception as e:  # a run deleted or a log down: its series are left out
                logger.debug("no offsets for run %s: %r", run, e)
                return None

        found = await asyncio.gather(*(one(run) for run in runs))
        self._projectors.offsets = dict(item for item in found if item is not None)

    def exposition(self, runs: RunScope = EVERY_RUN) -> bytes:
        """The text exposition; of the series labelled with a run, those of ``runs`` only."""
        if runs.every:
            return generate_latest(self.registry)
        only = CollectorRegistry(auto_describe=False)
        only.register(_OfRuns(self.registry, runs))
        return generate_latest(only)


class _OfRuns(Collector):
    """A registry's metrics with the samples of runs out of ``runs`` left out."""

    def __init__(self, registry: CollectorRegistry, runs: RunScope) -> None:
        self.registry = registry
        self.runs = runs

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [
                s
                for s in metric.samples
                if "run" not in s.labels or self.runs.covers(s.labels["run"])
            ]
            yield kept
