"""What traces and the request middleware cost (the rule: "no cost when disabled: measure it").

1. ``calls``: nanoseconds per call of each instrumentation point (``rolloutlog._telemetry``) with
   tracing off (no tracer provider: the state of a service without ``OTEL_*`` variables) and on
   (the SDK's provider, spans dropped by a processor that exports nothing), beside an empty
   ``with nullcontext()`` for scale, and the two ``prometheus_client`` operations the append
   path makes. Best of ``--runs`` timeit repeats, CPU time.
2. ``cpu_us_per_append_request``: CPU microseconds per append request through the app in
   process (``httpx.ASGITransport``, embedded log, SQLite catalog; 10 events a request) in three
   set-ups, interleaved run by run: ``bare`` (the ``Observe`` middleware removed: no request
   id, route histogram or access-log check), ``off`` (as served, tracing off) and ``on``
   (tracing on: FastAPI's server span and rolloutlog's, batched to an exporter that drops
   them). The code without any instrumentation cannot run in the same process, so the disabled
   path's cost per request is also given as the sum of the per-call costs an append request
   pays (``per_append_request_ns``).
3. ``observe_middleware_ns``: CPU ns per request of the ``Observe`` middleware alone (request id,
   route histogram, access-log check; the request id on the server span when on), around an
   app that answers at once.

Saved to ``benchmarks/results/tracing_overhead.json`` (``--quick``: ``tracing_overhead_quick.json``,
not committed).

    python benchmarks/tracing_overhead.py [--runs 5] [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from _common import save, summary
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter, Histogram

from rolloutlog import _telemetry
from rolloutlog.api import Settings, Tokens, create_app
from rolloutlog.api._metrics import LATENCY_BUCKETS, Metrics
from rolloutlog.api._observe import Observe
from rolloutlog.projections import Coordinator
from tests import factories as f
from tests.api.conftest import TOKENS, bearer, wire

RUN = "bench"
EPISODES = 100


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider() -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop()))
    return provider


def _calls(runs: int, number: int) -> dict[str, float]:
    headers = {"Authorization": "Bearer x"}
    attrs = {"rolloutlog.run": "r", "rolloutlog.events": 10}

    def empty() -> None:
        with contextlib.nullcontext():
            pass

    def span() -> None:
        with _telemetry.span("rolloutlog.append.log"):
            pass

    def span_attrs() -> None:
        with _telemetry.span("rolloutlog.projections", attrs):
            pass

    def set_attributes() -> None:
        _telemetry.set_attributes(attrs)

    def client_span() -> None:
        with _telemetry.client_span("GET", "/v1/runs/r/restores/3/projections", headers):
            pass

    def stage_parent() -> None:
        _telemetry.stage_parent()

    registry = CollectorRegistry()
    counter = Counter("bench_counter", "", registry=registry)
    histogram = Histogram("bench_seconds", "", buckets=LATENCY_BUCKETS, registry=registry)

    cases: dict[str, Callable[[], None]] = {
        # What an append request pays to metrics: 3 counters and 2 histograms (besides spans).
        "prometheus Counter.inc": counter.inc,
        "prometheus Histogram.observe": lambda: histogram.observe(0.003),
        "nullcontext (scale)": empty,
        # What FastAPI's telemetry would ask three times a request if it were left on.
        "opentelemetry get_tracer_provider()": trace.get_tracer_provider,
        "tracing()": _telemetry.tracing,
        "span": span,
        "span with attributes": span_attrs,
        "set_attributes": set_attributes,
        "client_span": client_span,
        "stage_parent": stage_parent,
    }
    return {
        name: min(timeit.repeat(call, timer=time.process_time, number=number, repeat=runs))
        / number
        * 1e9
        for name, call in cases.items()
    }


def _middleware_ns(runs: int, number: int) -> dict[str, float]:
    """CPU ns per request of ``Observe`` around an app that answers at once, minus the app
    alone: request id, route histogram, access-log check (and the request id on the server span
    while tracing)."""
    metrics = Metrics(Coordinator.__new__(Coordinator), lambda: 0)
    route = type("Route", (), {"path": "/v1/runs/{run}/events"})()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["route"] = route
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def observe(scope: Any, method: str, route: str, status: int, seconds: float) -> None:
        metrics.observe_request(method, route, status, seconds)

    observed = Observe(app, observe)  # type: ignore[arg-type]
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer x")]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        pass

    def scope() -> dict[str, Any]:
        return {"type": "http", "method": "POST", "path": "/v1/runs/r/events", "headers": headers}

    async def loop(target: Any) -> float:
        started = time.process_time()
        for _ in range(number):
            await target(scope(), receive, send)
        return time.process_time() - started

    def best(target: Any) -> float:
        return min(asyncio.run(loop(target)) for _ in range(runs)) / number * 1e9

    bare = best(app)
    return {"app alone": bare, "Observe": best(observed) - bare}


async def _cpu_us_per_append(mode: str, requests: int, data_dir: Path) -> float:
    settings = Settings(data_dir=data_dir, tokens=Tokens.from_mapping(TOKENS, "bench"))
    app = create_app(settings)
    if mode == "bare":
        app.user_middleware = [m for m in app.user_middleware if m.cls is not Observe]
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://bench"
        ) as client,
    ):
        admin = bearer("admin")
        await client.post("/v1/runs", json={"run": RUN, "partitions": 4}, headers=admin)
        reply = await client.post(
            f"/v1/runs/{RUN}/participants",
            json={"id": "env-0", "kind": "environment"},
            headers=admin,
        )
        assert reply.status_code == 201, reply.text
        sent = 0
        # Live episodes started once: each request then appends 10 boundaries (the steady
        # state of a rollout; an episode's start also writes a catalog row).
        starts = wire(*(f.started(f"e{i}") for i in range(EPISODES)))
        reply = await client.post(
            f"/v1/runs/{RUN}/events", json=starts, headers=bearer("participant")
        )
        assert reply.status_code == 200, reply.text
        bodies = [
            wire(*(f.boundary(f"e{i % EPISODES}", f"s{i}-{j}", {"j": j}) for j in range(10)))
            for i in range(requests)
        ]
        started = time.process_time()
        for body in bodies:
            response = await client.post(
                f"/v1/runs/{RUN}/events", json=body, headers=bearer("participant")
            )
            assert response.status_code == 200, response.text
            sent += 1
        # CPU seconds of this process (the app and its catalog thread run here): on a shared
        # machine, wall time measures the neighbours.
        return (time.process_time() - started) / sent * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    runs, requests, number = args.runs, args.requests, 200_000
    if args.quick:
        runs, requests, number = 1, 200, 20_000

    off = _calls(runs, number)
    middleware_off = _middleware_ns(runs, number // 10)
    with _telemetry.use_tracer_provider(_provider()):
        on = _calls(runs, number // 10)
        middleware_on = _middleware_ns(runs, number // 100)
    # An append request, tracing off: Observe's tracing() check, two spans, set_attributes.
    per_request = off["tracing()"] + 2 * off["span"] + off["set_attributes"]

    rates: dict[str, list[float]] = {"bare": [], "off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for mode in rates:
                data_dir = Path(tmp) / f"{mode}-{run}"
                if mode == "on":
                    with _telemetry.use_tracer_provider(_provider()):
                        rate = asyncio.run(_cpu_us_per_append(mode, requests, data_dir))
                else:
                    rate = asyncio.run(_cpu_us_per_append(mode, requests, data_dir))
                rates[mode].append(rate)
                print(f"run {run} {mode}: {rate:,.0f} us CPU per append request", flush=True)
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    results = {
        "calls_ns": {"tracing_off": off, "tracing_on": on},
        "per_append_request_ns": {"tracing_off": round(per_request, 1)},
        "observe_middleware_ns": {"tracing_off": middleware_off, "tracing_on": middleware_on},
        "appends_per_s": {mode: summary(values) for mode, values in rates.items()},
        "us_per_request_vs_bare": {
            mode: round((1 / medians[mode] - 1 / medians["bare"]) * 1e6, 1)
            for mode in ("off", "on")
        },
        "requests_per_run": requests,
        "events_per_request": 10,
    }
    path = save("tracing_overhead_quick" if args.quick else "tracing_overhead", results)
    for name, ns in off.items():
        print(f"{name:36s} off {ns:8.1f} ns   on {on[name]:8.1f} ns")
    print(f"disabled path per append request: {per_request:.0f} ns")
    print(f"Observe middleware: off {middleware_off}, on {middleware_on} ns per request")
    print({mode: round(m) for mode, m in medians.items()}, "us CPU per append request (median)")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
