"""Operations: health, readiness, metrics, the OpenAPI schema, the package's public surface."""

from __future__ import annotations

import logging

import orjson

from rolloutlog.api._logging import JsonFormatter
from tests import factories as f
from tests.api.conftest import Api


async def test_health_and_readiness(api: Api) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    ready = (await api.client.get("/readyz")).json()
    assert ready["status"] == "ready"
    assert ready["log"] == ready["catalog"] == "ok"
    assert ready["checks"] == {"log": "ok", "catalog": "ok"}
    assert all(health["status"] == "ok" for health in ready["runs"].values())


async def test_readiness_fails_when_the_catalog_is_gone(api: Api) -> None:
    await api.service.catalog.stop()
    try:
        response = await api.client.get("/readyz")
        assert response.status_code == 503
        assert response.json()["checks"]["catalog"] != "ok"
    finally:
        await api.service.catalog.start()


async def test_metrics_count_appends_refusals_durations_and_live_episodes(api: Api) -> None:
    await api.seed(["a", "b"])
    await api.append(f.boundary("a", "x", attempt=0))
    await api.call("GET", "/v1/runs/nope", "analyst", 404)
    await api.checkpoint()
    await api.restore()
    await api.append(f.boundary("a", "zombie", attempt=0), expect=409)
    text = (await api.client.get("/metrics")).text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["rolloutlog_appends_total"] == 3
    assert samples["rolloutlog_append_events_total"] == 5
    assert samples["rolloutlog_append_bytes_total"] > 500
    assert samples["rolloutlog_append_latency_seconds_count"] == 3
    assert samples['rolloutlog_append_latency_seconds_bucket{le="+Inf"}'] == 3
    assert samples['rolloutlog_refusals_total{code="unknown_run"}'] == 1
    assert samples['rolloutlog_refusals_total{code="attempt_fenced"}'] == 1
    assert (
        samples['rolloutlog_checkpoint_duration_seconds_count{outcome="committed",stage="total"}']
        == 1
    )
    assert (
        samples['rolloutlog_restore_duration_seconds_count{outcome="committed",stage="replay"}']
        == 1
    )
    assert samples['rolloutlog_live_episodes{run="run"}'] == 2
    assert "# TYPE rolloutlog_append_latency_seconds histogram" in text


async def test_openapi_documents_every_model(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    components = schema["components"]["schemas"]
    for name in (
        "CreateRun",
        "CheckpointRequest",
        "RestoreRequest",
        "CheckpointOut",
        "RestoreOut",
        "ProjectionOut",
        "ManifestOut",
        "ErrorOut",
        "AppendOut",
        "EpisodeList",
    ):
        assert name in components, name
    events = schema["paths"]["/v1/runs/{run}/events"]["post"]
    assert set(events["requestBody"]["content"]) == {"application/json", "application/x-ndjson"}
    assert "bearer" in orjson.dumps(schema["components"]["securitySchemes"]).decode().lower()


def test_logs_are_json_lines() -> None:
    record = logging.LogRecord("rolloutlog.api", logging.INFO, "x", 1, "hello %s", ("you",), None)
    record.run = "r1"
    line = orjson.loads(JsonFormatter().format(record))
    assert (line["level"], line["message"], line["run"]) == ("info", "hello you", "r1")
