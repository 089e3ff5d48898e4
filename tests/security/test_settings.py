"""The security settings' checks and the README's Security section against the code: what is
refused before any connection (and that the refusal never echoes a secret), and that every
variable and URL key the README names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rolloutlog.api import Settings
from rolloutlog.api._settings import SETTINGS
from rolloutlog.errors import ConfigurationError
from rolloutlog.log import open_log
from rolloutlog.log._kafka_security import OPTIONS, KafkaSecurity, public_url
from tests._services import ROOT


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"security_protocol": "TLS"}, "security_protocol 'TLS': one of PLAINTEXT"),
        ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, "needs sasl_username and"),
        ({"sasl_password": "hunter2"}, "sasl credentials given with security_protocol PLAINTEXT"),
        ({"ssl_cafile": "/ca.pem"}, "ssl_cafile given with security_protocol PLAINTEXT"),
        ({"security_protocol": "SSL", "ssl_cafile": "/nonexistent.pem"}, "ssl_cafile"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI"},
            "sasl_mechanism 'GSSAPI': one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_username": "u", "sasl_password_file": "/no"},
            "sasl_password_file: cannot read /no",
        ),
    ],
)
def test_a_setting_that_cannot_work_is_refused_before_connecting(
    options: dict[str, str], refusal: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        KafkaSecurity.from_options(options)
    assert refusal in refused.value.message
    assert "hunter2" not in refused.value.message


def test_credentials_in_the_url_are_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigurationError) as refused:
        open_log("kafka://user:hunter2@broker:9092")
    assert "hunter2" not in str(refused.value)


def test_the_logs_url_leaves_out_how_it_connects() -> None:
    url = (
        "kafka://b:9092?topic_prefix=p.&security_protocol=SASL_SSL&sasl_username=u"
        "&sasl_password=hunter2&ssl_cafile=/ca.pem"
    )
    assert public_url(url) == "kafka://b:9092?topic_prefix=p."
    assert public_url("kafka://b:9092?topic_prefix=p.") == "kafka://b:9092?topic_prefix=p."
    assert "hunter2" not in repr(
        KafkaSecurity.from_options(
            {"security_protocol": "SASL_SSL", "sasl_username": "u", "sasl_password": "hunter2"}
        )
    )


def test_kafka_settings_with_the_embedded_log_are_refused(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, kafka_security_protocol="SSL")
    with pytest.raises(ConfigurationError, match="--kafka-security-protocol: settings of a kafka"):
        _ = settings.log_options


def _security_section() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.split("\n## Security\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_security_section_names_only_real_variables_and_keys() -> None:
    section = _security_section()
    variables = {s.variable for s in SETTINGS} | {
        s.variable + "_FILE" for s in SETTINGS if s.secret
    }
    named = set(re.findall(r"ROLLOUTLOG_KAFKA_[A-Z_]+|ROLLOUTLOG_CATALOG_URL[A-Z_]*", section))
    assert named and named <= variables, named - variables
    flags = set(re.findall(r"--kafka-[a-z-]+", section))
    assert flags and flags <= {s.option for s in SETTINGS}, flags
    keys = re.search(r"URL query keys: (.*?)\. None of them", section, re.S)
    assert keys is not None
    listed = set(re.findall(r"`([a-z_]+)`", keys.group(1)))
    assert listed == set(OPTIONS)
