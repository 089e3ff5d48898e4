"""The service and the SDK's direct Kafka transport over TLS (Tansu behind the test CA's TLS
proxy, ``conftest``): the settings of ``--kafka-*`` / ``ROLLOUTLOG_KAFKA_*`` and the log URL's
query, appends, a checkpoint and a restore; and ``rolloutlog serve``'s one line when the broker
refuses its certificate check or its SASL credentials, with the password kept out of it."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from rolloutlog.api import Settings, Tokens
from rolloutlog.participants import Environment, KafkaTransport, Resources, Restores
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS, open_api
from tests.api.test_e2e import running_server
from tests.security.conftest import Certificates, TlsBroker, refused_start

pytestmark = pytest.mark.kafka


async def test_the_service_and_the_kafka_transport_checkpoint_and_restore_over_tls(
    tls_broker: TlsBroker, certificates: Certificates, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    before = tls_broker.proxy.handshakes
    settings = Settings(
        data_dir=tmp_path / "data",
        log_url=f"kafka://{tls_broker.bootstrap}?topic_prefix={prefix}",
        kafka_security_protocol="SSL",
        kafka_ssl_cafile=certificates.ca.cert,
        tokens=Tokens.from_mapping(TOKENS, "test"),
    )
    # The SDK's transport takes the same settings in the URL's query.
    direct = (
        f"kafka://{tls_broker.bootstrap}?topic_prefix={prefix}"
        f"&security_protocol=SSL&ssl_cafile={certificates.ca.cert}"
    )
    async with open_api(settings) as api:
        trainer = AsyncTrainerClient(client=api.client, token=TOKENS["trainer"])
        await trainer.create_run("tls", partitions=2)
        await trainer.take_over("tls")
        async with KafkaTransport(direct, client=api.client, token=TOKENS["participant"]) as kafka:
            env = Environment(kafka, "tls", "env-0")
            resources = Resources(kafka, "tls", "res-0", mode="exported")
            await env.register()
            await resources.register()
            for i in range(5):
                episode = await env.start_episode(f"e{i}", {"i": i})
                await resources.open_session(f"e{i}", f"s{i}", state={"n": i})
                await episode.boundary("seed", {"session": f"s{i}"})
            checkpoint = await trainer.checkpoint("tls")
            assert checkpoint.status == "committed"
            assert checkpoint.counts["continue"] == 5
            restore = await trainer.restore("tls")
            ready = await api.client.get("/readyz")
            assert ready.status_code == 200, ready.text
        restores = Restores(client=api.client, token=TOKENS["participant"])
        projection = await restores.fetch("tls", "e3", restore.restore_id)
        assert projection["capture_key"] == "e3-a1"
        assert resources.restored_state(projection, "s3") == {"n": 3}
    assert tls_broker.proxy.handshakes - before >= 4  # the service's clients and the SDK's


def test_serve_connects_with_the_tls_flags(
    tls_broker: TlsBroker, certificates: Certificates, tmp_path: Path
) -> None:
    flags = ["--log", f"kafka://{tls_broker.bootstrap}?topic_prefix=s{uuid.uuid4().hex[:10]}."]
    flags += ["--kafka-security-protocol", "SSL", "--kafka-ssl-cafile", str(certificates.ca.cert)]
    with running_server(tmp_path, *flags) as server:
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        created = httpx.post(
            f"{server.url}/v1/runs",
            json={"run": "served", "partitions": 2},
            headers={"Authorization": f"Bearer {TOKENS['trainer']}"},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        assert server.stop() == 0


def test_serve_refuses_to_start_with_a_wrong_ca_in_one_line(
    tls_broker: TlsBroker, certificates: Certificates, tmp_path: Path
) -> None:
    line, _ = refused_start(
        tmp_path,
        {"ROLLOUTLOG_KAFKA_SSL_CAFILE": str(certificates.wrong_ca.cert)},
        "--log",
        f"kafka://{tls_broker.bootstrap}?request_timeout_ms=5000",
        "--kafka-security-protocol",
        "SSL",
    )
    assert (
        f"cannot start: invalid_configuration: TLS handshake with {tls_broker.bootstrap} failed: "
        "certificate verify failed: unable to get local issuer certificate"
    ) in line


#: The SASL_SSL settings as the README's Security section gives them: its ``serve`` example
#: (flags, the password in ``ROLLOUTLOG_KAFKA_SASL_PASSWORD_FILE``), its Compose example
#: (variables, the secrets as files) and the log URL's query.
SASL_SSL_FORMS = ("flags", "variables", "url")


def _sasl_ssl_settings(
    form: str, bootstrap: str, ca: Path, user: Path, secret: Path
) -> tuple[dict[str, str], list[str]]:
    """The environment and the flags of ``rolloutlog serve`` for one of ``SASL_SSL_FORMS``."""
    log = f"kafka://{bootstrap}?request_timeout_ms=5000"
    if form == "flags":
        env = {"ROLLOUTLOG_KAFKA_SASL_PASSWORD_FILE": str(secret)}
        flags = ["--log", log, "--kafka-security-protocol", "SASL_SSL"]
        flags += ["--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-username", "rolloutlog"]
        return env, [*flags, "--kafka-ssl-cafile", str(ca)]
    if form == "variables":
        env = {
            "ROLLOUTLOG_LOG_URL": log,
            "ROLLOUTLOG_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "ROLLOUTLOG_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "ROLLOUTLOG_KAFKA_SASL_USERNAME_FILE": str(user),
            "ROLLOUTLOG_KAFKA_SASL_PASSWORD_FILE": str(secret),
            "ROLLOUTLOG_KAFKA_SSL_CAFILE": str(ca),
        }
        return env, []
    query = (
        "&security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512"
        f"&sasl_username_file={user}&sasl_password_file={secret}&ssl_cafile={ca}"
    )
    return {}, ["--log", log + query]


@pytest.mark.parametrize("form", SASL_SSL_FORMS)
def test_serve_with_sasl_ssl_settings_authenticates_and_keeps_the_password_out(
    sasl_broker: TlsBroker, certificates: Certificates, tmp_path: Path, form: str
) -> None:
    """The documented SASL_SSL settings, each way the README gives them: the service reaches
    the broker over TLS and runs the SCRAM exchange, which this broker refuses (it has no users:
    see ``test_kafka_tls``); its one line names that, and no output holds the password."""
    password = "pw-" + uuid.uuid4().hex
    secret = tmp_path / "kafka_password"
    secret.write_text(password + "\n")
    user = tmp_path / "kafka_username"
    user.write_text("rolloutlog\n")
    env, flags = _sasl_ssl_settings(form, sasl_broker.bootstrap, certificates.ca.cert, user, secret)
    line, output = refused_start(tmp_path, env, *flags, "--log-level", "debug")
    assert (
        f"cannot start: invalid_configuration: SASL SCRAM-SHA-512 authentication with "
        f"{sasl_broker.bootstrap} failed: the broker refused the credentials"
    ) in line
    assert password not in output
