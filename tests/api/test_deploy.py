"""The production deployment: the compose file is valid, passes secrets as files (never argv),
ships the ``.env.example`` it names and a Kafka listener for participants outside its network;
the image's and compose's variables start the service; and the service runs on Kafka and
PostgreSQL (Apache Kafka or Tansu, and the local PostgreSQL) through the same routes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from rolloutlog.api import Settings, Tokens
from tests import factories as f
from tests._services import ROOT, free_port
from tests.api.conftest import TOKENS, bearer, open_api


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return compose


def _env_example() -> dict[str, str]:
    """``.env.example``'s variables, ``${VAR}`` in a value replaced as Compose does."""
    found: dict[str, str] = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            found[name] = re.sub(r"\$\{(\w+)\}", lambda m: found[m.group(1)], value)
    return found


def _dockerfile_env() -> dict[str, str]:
    dockerfile = (ROOT / "Dockerfile").read_text()
    return dict(
        re.findall(
            r"\b(ROLLOUTLOG_\w+)=(\S+)", "".join(re.findall(r"^ENV (.*)$", dockerfile, re.M))
        )
    )


def test_compose_file_is_valid_and_complete() -> None:
    compose = _compose()
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
    volumes = set(compose["volumes"])
    for name in services:
        mounted = {v.split(":")[0] for v in services[name]["volumes"]}
        assert mounted <= volumes, name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '"rolloutlog", "serve"' in dockerfile
    assert "pip install '.[server]'" in dockerfile  # the service's packages are an extra
    assert _dockerfile_env()["ROLLOUTLOG_HOST"] == "0.0.0.0"


def test_compose_passes_secrets_as_files_not_argv() -> None:
    compose = _compose()
    services = compose["services"]
    service = services["rolloutlog"]
    assert "command" not in service  # configured by variables: nothing in argv
    env = service["environment"]
    assert env["ROLLOUTLOG_LOG_URL"] == "kafka://kafka:9092"
    secret_vars = {"ROLLOUTLOG_CATALOG_URL"} | {
        f"ROLLOUTLOG_TOKEN_{r}" for r in ("PARTICIPANT", "TRAINER", "ANALYST", "ADMIN")
    }
    for name in secret_vars:
        assert name not in env, name  # never the value itself
        assert env[name + "_FILE"].startswith("/run/secrets/"), name
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/")
    declared = compose["secrets"]
    for name, each in services.items():
        for secret in each.get("secrets", []):
            assert secret in declared, (name, secret)
            assert f"/run/secrets/{secret}" in each["environment"].values(), (name, secret)
    # No secret is interpolated into anything a container or `docker inspect` shows.
    sources = {declared[s]["environment"] for s in declared}
    assert sources == secret_vars | {"POSTGRES_PASSWORD"}
    text = yaml.safe_dump(services)
    for name in sources:
        assert "${" + name not in text, name


def test_env_example_holds_every_variable_the_compose_file_reads() -> None:
    compose_text = (ROOT / "docker-compose.yml").read_text()
    assert "cp .env.example .env" in compose_text
    example = _env_example()
    needed = set(re.findall(r"\$\{(\w+)", compose_text))
    needed |= {each["environment"] for each in _compose()["secrets"].values()}
    assert needed <= set(example), needed - set(example)
    # Secrets are left empty: the database and the service refuse to start until they are set.
    assert example["POSTGRES_PASSWORD"] == "" and example["ROLLOUTLOG_TOKEN_ADMIN"] == ""
    assert example["ROLLOUTLOG_CATALOG_URL"].startswith("postgresql://rolloutlog:@postgres:5432/")


def test_kafka_has_a_listener_for_participants_outside_the_network() -> None:
    kafka = _compose()["services"]["kafka"]
    env = kafka["environment"]
    assert "EXTERNAL://:9094" in env["KAFKA_LISTENERS"]
    assert "EXTERNAL://${KAFKA_EXTERNAL_HOST:-localhost}:9094" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "EXTERNAL:PLAINTEXT" in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert kafka["ports"] == ["${KAFKA_EXTERNAL_BIND:-127.0.0.1}:9094:9094"]


@pytest.mark.slow
@pytest.mark.postgres
def test_the_container_configuration_starts_the_service(
    postgres_schema: str, tmp_path: Path
) -> None:
    """The image's and the compose file's variables, as they are, start ``rolloutlog serve``
    (the secrets written as Compose writes them; the broker swapped for the embedded log, the
    database for a test schema, /data and /run/secrets for temporary directories)."""
    service = _compose()["services"]["rolloutlog"]
    secrets = tmp_path / "run-secrets"
    secrets.mkdir()
    values = {
        **_env_example(),
        "ROLLOUTLOG_CATALOG_URL": "postgres://" + postgres_schema.split("://", 1)[1],
        **{f"ROLLOUTLOG_TOKEN_{r.upper()}": TOKENS[r] for r in TOKENS},
    }
    for name, secret in _compose()["secrets"].items():
        (secrets / name).write_text(values[secret["environment"]])
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTLOG_")},
        **_dockerfile_env(),
        **{
            k: str(v).replace("/run/secrets", str(secrets))
            for k, v in service["environment"].items()
        },
        "ROLLOUTLOG_DATA_DIR": str(tmp_path / "data"),
        "ROLLOUTLOG_HOST": "127.0.0.1",
        "ROLLOUTLOG_PORT": str(port),
        "ROLLOUTLOG_LOG_LEVEL": "info",
    }
    del env["ROLLOUTLOG_LOG_URL"]  # kafka://kafka:9092 exists inside the compose network only
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutlog.api.cli", "serve"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/runs", timeout=5).status_code == 401  # tokens are on
        created = httpx.post(
            f"{url}/v1/runs", json={"run": "compose"}, headers=bearer("trainer"), timeout=30
        )
        assert created.status_code == 201, created.text
        assert not (tmp_path / "data" / "catalog.sqlite3").exists()  # the PostgreSQL catalog
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()


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
