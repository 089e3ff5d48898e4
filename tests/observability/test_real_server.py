"""A real server (``rolloutlog serve --access-log`` under uvicorn, exporting spans over OTLP/HTTP
to a receiver in this process, from ``OTEL_EXPORTER_OTLP_ENDPOINT`` alone) after a little
traffic: the metric names it exposes, the Grafana dashboard's queries, docs/api.md's metrics
table, the access and audit log lines, the exported spans."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from rolloutlog.trainer import TrainerClient
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import TOKENS, bearer, wire
from tests.api.test_e2e import Server

pytestmark = pytest.mark.slow

RUN = "observed"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
DASHBOARD = ROOT / "deploy" / "grafana" / "rolloutlog.json"

#: Every family the service exposes (process and Python collectors included).
FAMILIES = {
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
    "python_info",
    "python_gc_collections",
    "rolloutlog_http_request_duration_seconds",
    "rolloutlog_appends",
    "rolloutlog_append_events",
    "rolloutlog_append_bytes",
    "rolloutlog_append_latency_seconds",
    "rolloutlog_checkpoint_duration_seconds",
    "rolloutlog_restore_duration_seconds",
    "rolloutlog_refusals",
    "rolloutlog_generation_cuts",
    "rolloutlog_live_episodes",
    "rolloutlog_projector_applied_records",
    "rolloutlog_quarantined_records",
    "rolloutlog_run_healthy",
    "rolloutlog_log_end_offset",
    "rolloutlog_projector_applied_offset",
    "rolloutlog_projector_lag_records",
    "rolloutlog_inflight_appends",
}


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export request's body."""

    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Receiver.bodies = []
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def observed(
    tmp_path_factory: pytest.TempPathFactory, receiver: ThreadingHTTPServer
) -> Iterator[dict[str, Any]]:
    """Start a server, send traffic, scrape it, stop it; hand back what it showed."""
    tmp = tmp_path_factory.mktemp("observed")
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.server_address[1]}")
        env.setenv("OTEL_SERVICE_NAME", "rolloutlog-test")
        server = Server(tmp / "data", tokens, "--access-log")
        server.start()
    try:
        with TrainerClient(server.url, token=TOKENS["admin"]) as trainer:
            trainer.create_run(RUN, partitions=2)
            trainer.register_participant(RUN, "env-0", "environment")
            trainer.take_over(RUN)
            events = wire(f.started("a"), f.boundary("a", "s1", {"t": 1}))
            appended = httpx.post(
                f"{server.url}/v1/runs/{RUN}/events",
                json=events,
                headers={
                    **bearer("participant"),
                    "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01",
                    "X-Request-ID": "append-1",
                },
            )
            assert appended.status_code == 200, appended.text
            trainer.checkpoint(RUN)
            restore = trainer.restore(RUN)
            trainer.projection(RUN, "a", restore=restore.restore_id)
        missing = httpx.get(f"{server.url}/v1/runs/nope", headers=bearer("analyst"))
        assert missing.status_code == 404
        text = ""
        for _ in range(50):  # the projector applies the appended records in the background
            text = httpx.get(f"{server.url}/metrics").text
            if f'rolloutlog_projector_lag_records{{partition="0",run="{RUN}"}} 0.0' in text:
                break
        yield {
            "metrics": text,
            "appended": appended,
            "stop": lambda: (server.stop(), server.log.read_text())[1],
        }
    finally:
        server.stop()


@pytest.fixture(scope="module")
def output(observed: dict[str, Any]) -> str:
    """The server's stderr and stdout once stopped (spans are flushed at the stop)."""
    text: str = observed["stop"]()
    return text


def _samples(text: str) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def _log_lines(output: str, logger: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"ts"')]
    return [line for line in lines if line["logger"] == logger]


def test_every_metric_family_is_exposed(observed: dict[str, Any]) -> None:
    families = {family.name for family in text_string_to_metric_families(observed["metrics"])}
    assert families >= FAMILIES, FAMILIES - families
    samples = _samples(observed["metrics"])
    routes = {s.labels["route"] for s in samples["rolloutlog_http_request_duration_seconds_count"]}
    # Route templates, never raw paths; a request no route matched is one series.
    assert {
        "/v1/runs",
        "/v1/runs/{run}/events",
        "/v1/runs/{run}/checkpoints",
        "/v1/runs/{run}/restores",
        "/v1/runs/{run}/episodes/{episode}/projection",
    } <= routes
    assert not any(RUN in route for route in routes)
    lag = {
        s.labels["partition"]: s.value
        for s in samples["rolloutlog_projector_lag_records"]
        if s.labels["run"] == RUN
    }
    assert lag == {"0": 0.0, "1": 0.0}
    applied = samples["rolloutlog_projector_applied_records_total"]
    # 2 events, a marker per partition, the restore's attempt.started
    assert [s.value for s in applied if s.labels["run"] == RUN] == [5.0]
    refused = {s.labels["code"]: s.value for s in samples["rolloutlog_refusals_total"]}
    assert refused["unknown_run"] == 1
    stages = {
        (s.labels["stage"], s.labels["outcome"])
        for s in samples["rolloutlog_restore_duration_seconds_count"]
    }
    assert {("replay", "committed"), ("commit", "committed"), ("total", "committed")} <= stages


def test_the_dashboard_queries_only_exposed_metrics(observed: dict[str, Any]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 20
    queried = {
        name
        for expr in exprs
        for name in re.findall(r"\b((?:rolloutlog|process|python)_[a-z_]+)\b", expr)
    }
    exposed = set(_samples(observed["metrics"]))
    assert queried - exposed == set()
    # And every rolloutlog family is on the dashboard.
    families = {name for name in FAMILIES if name.startswith("rolloutlog_")}
    on_board = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in queried}
    assert families - on_board == set()


def test_docs_list_every_metric() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    for name in FAMILIES:
        if name.startswith("rolloutlog_"):
            assert f"`{name}" in doc, name


def test_request_ids_are_echoed(observed: dict[str, Any]) -> None:
    assert observed["appended"].headers["x-request-id"] == "append-1"


def test_access_log_lines(output: str) -> None:
    lines = _log_lines(output, "rolloutlog.access")
    appended = next(line for line in lines if line["request_id"] == "append-1")
    assert appended["method"] == "POST"
    assert appended["route"] == "/v1/runs/{run}/events"
    assert appended["path"] == f"/v1/runs/{RUN}/events"
    assert appended["status"] == 200
    assert appended["duration_ms"] > 0
    assert appended["trace_id"] == TRACE_ID
    assert appended["message"] == "POST /v1/runs/{run}/events 200"
    assert appended["level"] == "info"
    assert {line["status"] for line in lines} >= {200, 201, 404}
    # uvicorn's own text access log is replaced, not doubled.
    assert not [line for line in output.splitlines() if '"logger":"uvicorn.access"' in line]


def test_one_audit_line_per_checkpoint_and_restore(output: str) -> None:
    lines = _log_lines(output, "rolloutlog.audit")
    assert [line["audit"] for line in lines] == ["checkpoint", "restore"]
    checkpoint, restore = lines
    for line in lines:
        assert line["outcome"] == "committed"
        assert line["who"]["roles"] == ["admin"]
        assert len(line["who"]["token"]) == 12 and TOKENS["admin"] not in json.dumps(line)
        assert line["run"] == RUN
        assert line["duration_ms"] > 0
        assert len(line["request_id"]) == 16
        assert re.fullmatch(r"[0-9a-f]{32}", line["trace_id"])
    assert restore["restore_id"] == 1
    assert restore["checkpoint_id"] == checkpoint["checkpoint_id"]


def test_spans_are_exported_over_otlp(output: str) -> None:
    spans: dict[str, list[Any]] = {}
    services = set()
    for body in _Receiver.bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            services.add(attributes.get("service.name"))
            for scope in resource.scope_spans:
                for span in scope.spans:
                    spans.setdefault(span.name, []).append(span)
    assert services == {"rolloutlog-test"}
    (append,) = spans["POST /v1/runs/{run}/events"]
    assert append.trace_id.hex() == TRACE_ID  # the caller's traceparent
    assert append.parent_span_id.hex() == "00f067aa0ba902b7"
    (restore,) = spans["rolloutlog.restore"]
    (replay,) = spans["rolloutlog.restore.replay"]
    assert replay.parent_span_id == restore.span_id
