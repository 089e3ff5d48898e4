"""The Kafka log over TLS and SASL, for real: Tansu behind a TLS-terminating proxy with the
test CA's certificate (``conftest``), reached only over TLS.

What cannot be exercised here (README, Security): a successful SASL login. Tansu 0.6 (the only
broker installable here) creates SCRAM users through the broker (``tansu user create``), which
refuses that request before a login while ``--authentication`` is on; without it the broker
takes the user but offers no SASL mechanism at all. Users stay in the broker process's memory
(its S3 storage keeps topics only), so no second broker can pick them up. So the tests show the
SASL exchange reaching the broker over TLS and its refusal reported in one line; the success
path is aiokafka's own SCRAM code.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from rolloutlog.errors import BackendUnavailable, ConfigurationError
from rolloutlog.log import Record, open_log
from rolloutlog.log.kafka import KafkaLog
from tests.security.conftest import Certificates, TlsBroker

pytestmark = pytest.mark.kafka


def _url(bootstrap: str, ca: Path, **query: str) -> str:
    extra = "".join(f"&{key}={value}" for key, value in query.items())
    prefix = f"t{uuid.uuid4().hex[:8]}."
    return f"kafka://{bootstrap}?topic_prefix={prefix}&security_protocol=SSL&ssl_cafile={ca}{extra}"


async def test_appends_and_reads_go_over_tls_with_the_certificate_checked(
    tls_broker: TlsBroker, certificates: Certificates
) -> None:
    before = tls_broker.proxy.handshakes
    log = open_log(_url(tls_broker.bootstrap, certificates.ca.cert))
    assert isinstance(log, KafkaLog)
    assert "ssl_cafile" not in log.url and "security_protocol" not in log.url
    async with log:
        await log.ensure_run("tls", 2)
        records = [Record(p, b"k", f"value-{p}-{i}".encode()) for p in (0, 1) for i in range(3)]
        positions = await log.append_records("tls", records)
        assert sorted(positions) == [(p, o) for p in (0, 1) for o in range(3)]
        read = [item async for item in log.read_records("tls", 1, 0, 3)]
        assert read == [(o, f"value-1-{o}".encode()) for o in range(3)]
        assert await log.end_offsets("tls") == [3, 3]
    # The producers, the admin and control clients and the readers each handshook.
    assert tls_broker.proxy.handshakes - before >= 3


@pytest.mark.parametrize(
    ("bootstrap_host", "which", "cause"),
    [
        ("127.0.0.1", "wrong_ca", "certificate verify failed: unable to get local issuer"),
        ("localhost", "ca", "certificate verify failed: Hostname mismatch"),
    ],
)
async def test_a_certificate_that_does_not_check_out_is_refused_in_one_line(
    tls_broker: TlsBroker, certificates: Certificates, bootstrap_host: str, which: str, cause: str
) -> None:
    port = tls_broker.bootstrap.rsplit(":", 1)[1]
    ca = getattr(certificates, which).cert
    log = open_log(_url(f"{bootstrap_host}:{port}", ca, request_timeout_ms="5000"))
    with pytest.raises(ConfigurationError) as refused:
        await log.start()
    message = refused.value.message
    assert message.startswith(f"TLS handshake with {bootstrap_host}:{port} failed: {cause}")
    assert "\n" not in message


async def test_plaintext_to_the_tls_listener_does_not_pass_for_a_broker(
    tls_broker: TlsBroker,
) -> None:
    log = open_log(f"kafka://{tls_broker.bootstrap}?request_timeout_ms=3000")
    with pytest.raises(BackendUnavailable):
        await log.start()


@pytest.mark.parametrize(
    ("mechanism", "cause"),
    [
        ("SCRAM-SHA-512", "failed: the broker refused the credentials"),
        ("SCRAM-SHA-256", "failed: the broker refused the credentials"),
        # Tansu offers SCRAM only, and drops the connection of a client asking for PLAIN
        # (the client sees an EOF or a reset, depending on timing).
        ("PLAIN", "failed: "),
    ],
)
async def test_sasl_over_tls_reaches_the_broker_and_its_refusal_is_one_line(
    sasl_broker: TlsBroker, certificates: Certificates, tmp_path: Path, mechanism: str, cause: str
) -> None:
    password = tmp_path / "password"
    password.write_text("not-a-user-of-this-broker\n")
    log = open_log(
        _url(
            sasl_broker.bootstrap,
            certificates.ca.cert,
            request_timeout_ms="5000",
        ).replace("security_protocol=SSL", "security_protocol=SASL_SSL")
        + f"&sasl_mechanism={mechanism}&sasl_username=nobody&sasl_password_file={password}",
    )
    assert isinstance(log, KafkaLog) and log.security.sasl_password == "not-a-user-of-this-broker"
    assert "sasl" not in log.url and "not-a-user" not in repr(log.security)
    with pytest.raises(ConfigurationError) as refused:
        await log.start()
    message = refused.value.message
    assert message.startswith(f"SASL {mechanism} authentication with {sasl_broker.bootstrap} ")
    assert cause in message and "\n" not in message
    assert "not-a-user-of-this-broker" not in message
