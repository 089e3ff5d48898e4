"""``rolloutlog serve`` configured from the environment: every setting from its ``ROLLOUTLOG_*``
variable, the secrets from ``*_FILE`` files, one precedence rule (flag > variable > file >
default), ``postgres://`` URLs, and start-up failures as one line with the exit code. A service
started from the environment alone (the container's variables): tests/api/test_deploy.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from rolloutlog.api import Role, Tokens
from rolloutlog.api._config import ServeConfig
from rolloutlog.api._settings import SETTINGS
from rolloutlog.catalog import open_catalog
from rolloutlog.errors import ConfigurationError
from rolloutlog.projections import DEFAULT_LEASE_S
from tests._services import free_port
from tests.api.conftest import TOKENS

SERVE = (sys.executable, "-m", "rolloutlog.api.cli", "serve")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``ROLLOUTLOG_*`` setting of the machine leaks in (the tests' own stay)."""
    for name in list(os.environ):
        if name.startswith("ROLLOUTLOG_") and not name.startswith(
            ("ROLLOUTLOG_TEST_", "ROLLOUTLOG_REQUIRE_")
        ):
            monkeypatch.delenv(name)


def test_one_precedence_rule_flag_variable_file_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert ServeConfig.load({}, {}).catalog_url is None  # the default: SQLite under the data dir
    secret = tmp_path / "catalog_url"
    secret.write_text("postgres://rolloutlog:pw@db/rolloutlog\n")  # a secrets file's newline
    monkeypatch.setenv("ROLLOUTLOG_CATALOG_URL_FILE", str(secret))
    assert ServeConfig.load({}, {}).catalog_url == "postgres://rolloutlog:pw@db/rolloutlog"
    monkeypatch.setenv("ROLLOUTLOG_CATALOG_URL", "postgresql://from-the-variable/db")
    assert ServeConfig.load({}, {}).catalog_url == "postgresql://from-the-variable/db"
    flag = {"catalog_url": "sqlite+aiosqlite:///flag.sqlite3"}
    assert ServeConfig.load(flag, {}).catalog_url == "sqlite+aiosqlite:///flag.sqlite3"
    # An empty variable counts as unset (``VAR=`` in an env file): the file applies again.
    monkeypatch.setenv("ROLLOUTLOG_CATALOG_URL", "")
    assert ServeConfig.load({}, {}).catalog_url == "postgres://rolloutlog:pw@db/rolloutlog"
    monkeypatch.setenv("ROLLOUTLOG_PORT", "9001")
    assert ServeConfig.load({}, {}).port == 9001
    assert ServeConfig.load({"port": 9002}, {}).port == 9002


def test_every_setting_comes_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "DATA_DIR": "/srv/rolloutlog",
        "HOST": "0.0.0.0",
        "PORT": "9000",
        "LOG_URL": "kafka://kafka:9092",
        "CATALOG_URL": "postgresql://u@db/x",
        "TOKENS": "/etc/rolloutlog/tokens.toml",
        "KEEP_COMMITTED": "5",
        "MAX_BODY_MB": "64",
        "VALIDATION_WORKERS": "2",
        "LOG_LEVEL": "warning",
        "ACCESS_LOG": "true",
        "SHUTDOWN_TIMEOUT": "12.5",
        "HEADER_TIMEOUT": "4",
        "BODY_TIMEOUT": "6",
        "MIN_BODY_RATE": "512",
        "MAX_CONNECTIONS": "900",
        "RESERVED_CONNECTIONS": "16",
        "MAX_INFLIGHT_APPENDS": "8",
        "REPLICA_ID": "replica-a",
        "LEASE_S": "2.5",
        "MAX_REQUEST_MB": "3",
        "MAX_SEQ_GAP": "4096",
        "METRICS_AUTH": "true",
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SASL_USERNAME": "rolloutlog",
        "KAFKA_SASL_PASSWORD": "pw",
        "KAFKA_SSL_CAFILE": "/etc/ssl/kafka-ca.pem",
        "KAFKA_SSL_CERTFILE": "/etc/ssl/client.pem",
        "KAFKA_SSL_KEYFILE": "/etc/ssl/client.key",
    }
    assert {name.lower() for name in values} == set(ServeConfig.model_fields)
    for name, value in values.items():
        monkeypatch.setenv(f"ROLLOUTLOG_{name}", value)
    config = ServeConfig.load({}, {})
    assert (config.host, config.port, config.tokens) == (
        "0.0.0.0",
        9000,
        Path("/etc/rolloutlog/tokens.toml"),
    )
    assert (config.log_level, config.access_log) == ("warning", True)
    settings = config.settings(Tokens())
    assert settings.data_dir == Path("/srv/rolloutlog")
    assert (settings.log_url, settings.catalog_url) == ("kafka://kafka:9092", "postgresql://u@db/x")
    assert (settings.keep_committed, settings.max_events_bytes) == (5, 64 * 1024 * 1024)
    assert (settings.validation_workers, settings.drain_timeout_s) == (2, 12.5)
    assert (settings.header_timeout_s, settings.body_timeout_s) == (4, 6)
    assert settings.max_inflight_appends == 8
    assert (settings.min_body_rate, settings.max_connections) == (512, 900)
    assert settings.reserved_connections == 16
    assert (settings.replica_id, settings.lease_s) == ("replica-a", 2.5)
    assert settings.address == "0.0.0.0:9000"
    assert (settings.max_request_bytes, settings.max_seq_gap) == (3 * 1024 * 1024, 4096)
    assert settings.metrics_auth
    assert settings.log_options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "rolloutlog",
        "sasl_password": "pw",
        "ssl_cafile": "/etc/ssl/kafka-ca.pem",
        "ssl_certfile": "/etc/ssl/client.pem",
        "ssl_keyfile": "/etc/ssl/client.key",
    }


def test_each_setting_is_declared_once_with_its_flag_and_variable() -> None:
    """``serve``'s flags and ``ServeConfig``'s fields are generated from ``SETTINGS``: one
    name per setting (the flag's and the variable's), its default in the flag's unit."""
    names = [setting.name for setting in SETTINGS]
    assert len(names) == len(set(names))
    assert set(ServeConfig.model_fields) == set(names)
    defaults = ServeConfig.load({}, {}).settings(Tokens())
    for setting in SETTINGS:
        if setting.default is not None:
            assert getattr(defaults, setting.field) == setting.default, setting.name
    lease = next(setting for setting in SETTINGS if setting.name == "lease_s")
    assert lease.shown_default == f"{DEFAULT_LEASE_S:g}"  # --help's default is the loop's
    assert defaults.lease_s == DEFAULT_LEASE_S


def test_the_configuration_table_lists_every_setting() -> None:
    docs = Path(__file__).parents[2] / "docs" / "api.md"
    table = docs.read_text(encoding="utf-8").split("### Configuration", 1)[1].split("\n\n|", 1)[1]
    rows = {
        line.split("|")[1].split()[0].strip("`"): line
        for line in table.split("\n")
        if line.startswith("| `--")
    }
    for setting in SETTINGS:
        assert setting.option in rows, setting.option
        assert setting.variable in rows[setting.option], setting.option


def test_a_replica_is_named_after_its_host_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    host = socket.gethostname()
    assert ServeConfig.load({"port": 9100}, {}).settings(Tokens()).replica_id == host
    kafka = ServeConfig.load({"port": 9100, "log_url": "kafka://k:9092"}, {})
    assert kafka.settings(Tokens()).replica_id == f"{host}:9100"
    assert kafka.settings(Tokens()).lease_s == 6.0
    monkeypatch.setenv("ROLLOUTLOG_REPLICA_ID", "r7")
    assert ServeConfig.load({}, {}).settings(Tokens()).replica_id == "r7"
    monkeypatch.setenv("ROLLOUTLOG_LEASE_S", "0")
    with pytest.raises(ConfigurationError, match=r"^ROLLOUTLOG_LEASE_S: .*greater than 0"):
        ServeConfig.load({}, {})


def test_a_bad_value_names_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ROLLOUTLOG_PORT", "http")
    with pytest.raises(ConfigurationError, match=r"^ROLLOUTLOG_PORT: .*valid integer.*'http'"):
        ServeConfig.load({}, {})
    monkeypatch.delenv("ROLLOUTLOG_PORT")
    with pytest.raises(ConfigurationError, match=r"^--keep-committed: .*greater than 0"):
        ServeConfig.load({"keep_committed": 0}, {"keep_committed": "--keep-committed"})
    monkeypatch.setenv("ROLLOUTLOG_LOG_LEVEL", "chatty")
    with pytest.raises(ConfigurationError, match=r"ROLLOUTLOG_LOG_LEVEL: .*debug, info"):
        ServeConfig.load({}, {})
    monkeypatch.delenv("ROLLOUTLOG_LOG_LEVEL")
    monkeypatch.setenv("ROLLOUTLOG_LOG_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match=r"^ROLLOUTLOG_LOG_URL_FILE: cannot read "):
        ServeConfig.load({}, {})


def test_tokens_come_from_their_variables_or_files(tmp_path: Path) -> None:
    trainer = tmp_path / "trainer"
    trainer.write_text(f"{TOKENS['trainer']}\n{TOKENS['admin']}\n")  # one per line
    tokens = Tokens.from_env(
        {
            "ROLLOUTLOG_TOKEN_TRAINER_FILE": str(trainer),
            "ROLLOUTLOG_TOKEN_ANALYST": TOKENS["analyst"],
            "ROLLOUTLOG_TOKEN_ANALYST_FILE": str(tmp_path / "never-read"),
        }
    )
    assert tokens.roles_of(TOKENS["trainer"]) == {Role.TRAINER}
    assert tokens.roles_of(TOKENS["admin"]) == {Role.TRAINER}
    assert tokens.roles_of(TOKENS["analyst"]) == {Role.ANALYST}  # the variable wins
    with pytest.raises(ConfigurationError, match="ROLLOUTLOG_TOKEN_ADMIN_FILE"):
        Tokens.from_env({"ROLLOUTLOG_TOKEN_ADMIN_FILE": str(tmp_path / "missing")})


@pytest.mark.postgres
@pytest.mark.parametrize("scheme", ["postgres://", "postgresql://", "postgresql+asyncpg://"])
async def test_every_spelling_of_a_postgresql_url_opens_the_catalog(
    postgres_schema: str, scheme: str
) -> None:
    url = scheme + postgres_schema.split("://", 1)[1]
    async with open_catalog(url) as catalog:
        run = f"spelled-{uuid.uuid4().hex[:6]}"
        await catalog.create_run(run, log_url="embedded:///nowhere", partitions=2)
        assert (await catalog.get_run(run)).partitions == 2


def _one_line_failure(env: dict[str, str], *args: str, cwd: Path) -> tuple[int, str]:
    done = subprocess.run(
        [*SERVE, *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and done.stdout == "", done.stderr
    assert lines[0].startswith("rolloutlog serve: cannot start: "), lines[0]
    assert lines[0].endswith(f"(exit {done.returncode})"), lines[0]
    return done.returncode, lines[0]


@pytest.mark.slow
def test_a_bad_setting_or_a_taken_port_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    status, line = _one_line_failure(
        {"ROLLOUTLOG_PORT": "eighty"}, "--data-dir", str(data), cwd=tmp_path
    )
    assert status == 2 and "invalid_configuration: ROLLOUTLOG_PORT: " in line
    status, line = _one_line_failure(
        {"ROLLOUTLOG_TOKENS": str(tmp_path / "no-tokens.toml")},
        "--data-dir",
        str(data),
        cwd=tmp_path,
    )
    assert status == 2 and "cannot read the token file" in line
    status, line = _one_line_failure(
        {"ROLLOUTLOG_HOST": "0.0.0.0"}, "--data-dir", str(data), cwd=tmp_path
    )
    assert status == 2 and "refusing to listen on 0.0.0.0 without tokens" in line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, line = _one_line_failure(
            {"ROLLOUTLOG_PORT": str(port), "ROLLOUTLOG_DATA_DIR": str(data)}, cwd=tmp_path
        )
    assert status == 1 and f"cannot_listen: 127.0.0.1:{port}: " in line, line
    # Refused before the log or the catalog opened: nothing was created or migrated.
    assert not (data / "catalog.sqlite3").exists() and not (data / "log").exists()


@pytest.mark.slow
@pytest.mark.postgres
def test_a_missing_database_is_one_line(postgres_url: str, tmp_path: Path) -> None:
    missing = make_url(postgres_url).set(database=f"missing_{uuid.uuid4().hex[:8]}")
    url = "postgres://" + missing.render_as_string(hide_password=False).split("://", 1)[1]
    status, line = _one_line_failure(
        {"ROLLOUTLOG_CATALOG_URL": url, "ROLLOUTLOG_PORT": str(free_port())},
        "--data-dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert status == 1
    assert (
        f'catalog_error: catalog failed: DBAPIError: database "{missing.database}" does not exist'
        in line
    )
