"""The production deployment: the compose file is valid, and the service runs on Kafka and
PostgreSQL (Apache Kafka or Tansu, and the local PostgreSQL) through the same routes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from rolloutlog.api import Settings, Tokens
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import TOKENS, open_api


def test_compose_file_is_valid_and_complete() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"kafka", "postgres", "rolloutlog"}
    for name, service in services.items():
        assert "healthcheck" in service, name
        assert service["healthcheck"]["test"], name
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert "zookeeper" not in str(compose).lower()
    service = services["rolloutlog"]
    assert service["depends_on"] == {
        "kafka": {"condition": "service_healthy"},
        "postgres": {"condition": "service_healthy"},
    }
    command = " ".join(service["command"])
    assert "--log kafka://kafka:9092" in command
    assert "--catalog postgresql+asyncpg://" in command
    assert {f"ROLLOUTLOG_TOKEN_{r}" for r in ("PARTICIPANT", "TRAINER", "ANALYST", "ADMIN")} <= set(
        service["environment"]
    )
    volumes = set(compose["volumes"])
    for name in services:
        mounted = {v.split(":")[0] for v in services[name]["volumes"]}
        assert mounted <= volumes, name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '"--host", "0.0.0.0"' in dockerfile


@pytest.mark.kafka
@pytest.mark.postgres
async def test_the_service_on_kafka_and_postgresql(
    kafka_bootstrap: str, postgres_schema: str, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_url=f"kafka://{kafka_bootstrap}?topic_prefix=t{uuid.uuid4().hex[:10]}.",
        catalog_url=postgres_schema,
        tokens=Tokens.from_mapping(TOKENS, "test"),
    )
    async with open_api(settings) as api:
        assert (await api.client.get("/readyz")).json()["status"] == "ready"
        await api.seed(["a", "b"])
        await api.register("policy-0", "policy")  # an unregistered participant is refused
        await api.append(
            f.ledger_row("a", "c1", [1, 2, 3]), f.boundary("a", "invoke_agent", {"turn": 2})
        )
        await api.append(f.finished("b"))
        checkpoint = await api.checkpoint()
        assert checkpoint["counts"] == {"continue": 1, "restart": 0, "finished": 1}
        restore = await api.restore()
        assert restore["counts"] == {"continue": 1, "restart": 0, "excluded": 0}
        projection = await api.call(
            "GET",
            f"/v1/runs/run/episodes/a/projection?restore={restore['restore_id']}",
            "participant",
            200,
        )
        body = projection.json()
        assert (body["capture_key"], body["boundaries"]["environment"]["state"]) == (
            "a-a1",
            {"turn": 2},
        )
        assert body["ledger"][0]["token_ids"] == [1, 2, 3]
        fenced = await api.append(f.boundary("a", "zombie", attempt=0), expect=409)
        assert fenced.json()["error"]["code"] == "attempt_fenced"
