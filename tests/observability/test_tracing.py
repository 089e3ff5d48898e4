"""Traces: one restore followed from the trainer client through a real uvicorn server (in this
process, so that the SDK's in-memory exporter sees both sides) to each participant's fetch."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rolloutlog import _telemetry
from rolloutlog.api import create_app
from rolloutlog.errors import ConfigurationError
from rolloutlog.participants import Restores
from rolloutlog.trainer import AsyncTrainerClient, resume_run
from tests import factories as f
from tests._services import free_port
from tests.api.conftest import TOKENS, bearer, settings_for, wire

RUN = "traced"


@dataclass
class Traced:
    url: str
    exporter: InMemorySpanExporter
    provider: TracerProvider

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
async def traced(tmp_path: Path) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port = free_port()
    with _telemetry.use_tracer_provider(provider):
        app = create_app(settings_for(tmp_path / "data"))
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        for _ in range(300):
            if server.started:
                break
            assert not serving.done(), serving
            await asyncio.sleep(0.02)
        try:
            yield Traced(f"http://127.0.0.1:{port}", exporter, provider)
        finally:
            server.should_exit = True
            await serving


async def _seed(url: str, trainer: AsyncTrainerClient) -> None:
    await trainer.create_run(RUN, partitions=2)
    await trainer.register_participant(RUN, "env-0", "environment")
    await trainer.take_over(RUN)
    events = [f.started(e) for e in ("a", "b")] + [f.boundary(e, "s1", {"t": 1}) for e in "ab"]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            f"/v1/runs/{RUN}/events", json=wire(*events), headers=bearer("participant")
        )
        assert response.status_code == 200, response.text


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind | None = None) -> ReadableSpan:
    found = [s for s in spans if s.name == name and (kind is None or s.kind == kind)]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


async def test_a_restore_is_one_trace_from_the_trainer_to_each_participant_fetch(
    traced: Traced,
) -> None:
    tracer = traced.provider.get_tracer("trainer")
    async with AsyncTrainerClient(traced.url, token=TOKENS["admin"]) as trainer:
        await _seed(traced.url, trainer)
        with tracer.start_as_current_span("resume") as root:
            await trainer.checkpoint(RUN)
            restore = await trainer.restore(RUN)
            async with Restores(traced.url, token=TOKENS["participant"]) as participant:
                fetched = [p async for p in participant.install(RUN, restore.restore_id)]
                one = await participant.fetch(RUN, "a", restore.restore_id)
    assert {p["episode"] for p in fetched} == {"a", "b"}
    assert one["episode"] == "a"

    trace_id = root.get_span_context().trace_id
    spans = [s for s in traced.spans() if s.context is not None]
    in_trace = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]

    # trainer client → service: the server span is the client span's child.
    for method, route in (
        ("POST", "/v1/runs/{run}/checkpoints"),
        ("POST", "/v1/runs/{run}/restores"),
        ("GET", "/v1/runs/{run}/restores/{id}/projections"),
        ("GET", "/v1/runs/{run}/episodes/{episode}/projection"),
    ):
        client = _one(in_trace, f"{method} {route}", SpanKind.CLIENT)
        server = _one(
            in_trace, f"{method} {route.replace('{id}', '{restore_id}')}", SpanKind.SERVER
        )
        assert server.parent is not None and client.context is not None
        assert server.parent.span_id == client.context.span_id
        assert server.attributes is not None
        assert server.attributes["http.response.status_code"] in (200, 201)

    # service → the restore's stages (the commit stage is the catalog transaction).
    restore_server = _one(in_trace, "POST /v1/runs/{run}/restores", SpanKind.SERVER)
    (restore_span,) = _children(in_trace, restore_server)
    assert restore_span.name == "rolloutlog.restore"
    assert restore_span.attributes is not None
    assert restore_span.attributes["rolloutlog.outcome"] == "committed"
    stages = [
        s.name for s in sorted(_children(in_trace, restore_span), key=lambda s: s.start_time or 0)
    ]
    assert stages == [
        "rolloutlog.restore.manifest",
        "rolloutlog.restore.replay",
        "rolloutlog.restore.verify",
        "rolloutlog.restore.attempts",
        "rolloutlog.restore.commit",
    ]
    checkpoint_server = _one(in_trace, "POST /v1/runs/{run}/checkpoints", SpanKind.SERVER)
    (checkpoint_span,) = _children(in_trace, checkpoint_server)
    checkpoint_stages = {s.name for s in _children(in_trace, checkpoint_span)}
    assert {
        "rolloutlog.checkpoint.markers",
        "rolloutlog.checkpoint.projector",
        "rolloutlog.checkpoint.manifest",
        "rolloutlog.checkpoint.commit",
    } <= checkpoint_stages

    # … → each participant fetch: the projections read under the fetch's server span.
    for route in (
        "/v1/runs/{run}/restores/{restore_id}/projections",
        "/v1/runs/{run}/episodes/{episode}/projection",
    ):
        fetch = _one(in_trace, f"GET {route}", SpanKind.SERVER)
        assert [s.name for s in _children(in_trace, fetch)] == ["rolloutlog.projections"]

    # The seeding calls made outside the root span are traces of their own.
    seeded = _one(spans, "POST /v1/runs/{run}/events", SpanKind.SERVER)
    assert seeded.context is not None and seeded.context.trace_id != trace_id
    # An append: validation (and fencing), then the durable append to the log.
    assert seeded.attributes is not None and seeded.attributes["rolloutlog.events"] == 4
    assert [s.name for s in _children(spans, seeded)] == [
        "rolloutlog.append.validate",
        "rolloutlog.append.log",
    ]


async def test_resume_run_is_one_trace(traced: Traced) -> None:
    async with AsyncTrainerClient(traced.url, token=TOKENS["admin"]) as trainer:
        await _seed(traced.url, trainer)
        await trainer.checkpoint(RUN)
        plan = await resume_run(trainer, RUN)
    assert {d.episode for d in plan.continued} == {"a", "b"}
    spans = traced.spans()
    root = _one(spans, "rolloutlog.resume_run")
    assert root.parent is None and root.context is not None
    in_trace = [s for s in spans if s.context and s.context.trace_id == root.context.trace_id]
    calls = [s.name for s in _children(in_trace, root)]
    assert calls == [
        "POST /v1/runs/{run}/controller",
        "POST /v1/runs/{run}/restores",
        "GET /v1/runs/{run}/restores/{id}/episodes",
        "GET /v1/runs/{run}/checkpoints/{id}/manifest",
        "GET /v1/runs/{run}/results",
    ]
    restore = _one(in_trace, "POST /v1/runs/{run}/restores", SpanKind.SERVER)
    assert [s.name for s in _children(in_trace, restore)] == ["rolloutlog.restore"]


async def test_the_service_answers_its_callers_traceparent_and_request_id(traced: Traced) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with httpx.AsyncClient(base_url=traced.url) as client:
        response = await client.get(
            "/healthz",
            headers={
                "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
                "X-Request-ID": "req-42",
            },
        )
        unnamed = await client.get("/healthz")
    assert response.headers["x-request-id"] == "req-42"
    assert len(unnamed.headers["x-request-id"]) == 16
    health = [s for s in traced.spans() if s.name == "GET /healthz"]
    assert len(health) == 2
    theirs = next(
        s for s in health if s.attributes and s.attributes["rolloutlog.request_id"] == "req-42"
    )
    assert theirs.context is not None and theirs.parent is not None
    assert f"{theirs.context.trace_id:032x}" == trace_id
    assert f"{theirs.parent.span_id:016x}" == "00f067aa0ba902b7"


def test_disabled_tracing_is_one_shared_no_op() -> None:
    assert not _telemetry.tracing()
    first = _telemetry.span("a")
    assert first is _telemetry.span("b", {"x": 1})
    headers = {"Authorization": "Bearer x"}
    with _telemetry.client_span("GET", "/v1/runs/r", headers) as sent:
        assert sent is headers  # no copy, no traceparent
    assert _telemetry.stage_parent() is None
    assert _telemetry.current_trace_id() is None


def test_client_span_names_are_templates() -> None:
    assert _telemetry.path_template("/v1/runs/r-1/restores/12/projections") == (
        "/v1/runs/{run}/restores/{id}/projections"
    )
    assert _telemetry.path_template("/v1/runs/r/episodes/ep-7/projection?restore=3") == (
        "/v1/runs/{run}/episodes/{episode}/projection"
    )
    assert _telemetry.path_template("/v1/runs/r/checkpoints/latest") == (
        "/v1/runs/{run}/checkpoints/latest"
    )


def test_the_exporter_comes_from_the_otel_variables() -> None:
    names = _telemetry._exporter_names
    assert names({}) == []
    assert names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert names({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert names({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) == []
    assert names({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) == []
    with pytest.raises(ConfigurationError, match="zipkin"):
        _telemetry._exporter("zipkin", {})


def test_a_missing_otlp_extra_is_a_configuration_error() -> None:
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None:
        pytest.skip("the gRPC exporter is installed here")
    with pytest.raises(ConfigurationError, match=r"rolloutlog\[otlp\]"):
        _telemetry._exporter("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
