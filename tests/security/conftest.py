"""Fixtures of the security tests: a test CA (and a second, wrong one), and Tansu behind a
TLS-terminating proxy (``_tls``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._services import ROOT, free_port, tansu_broker, unavailable
from tests.security._tls import Authority, TlsProxy, authority


@dataclass(frozen=True)
class Certificates:
    ca: Authority
    #: A CA that signed none of the certificates here.
    wrong_ca: Authority
    #: The broker's proxy's (and PostgreSQL's) certificate, for 127.0.0.1 only.
    server: tuple[Path, Path]
    #: A certificate for ``localhost`` only.
    localhost: tuple[Path, Path]


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    directory = tmp_path_factory.mktemp("certs")
    ca = authority(directory, "test-ca")
    return Certificates(
        ca,
        authority(directory, "wrong-ca"),
        ca.issue("broker", ips=["127.0.0.1"]),
        ca.issue("localhost", dns=["localhost"]),
    )


@dataclass(frozen=True)
class TlsBroker:
    proxy: TlsProxy
    #: ``host:port`` of the TLS listener (the proxy), which the broker's metadata advertises.
    bootstrap: str


def _tls_broker(certificates: Certificates, args: tuple[str, ...] = ()) -> Iterator[TlsBroker]:
    port = free_port()
    try:
        broker = tansu_broker(advertised_port=port, args=args)
        plain = broker.__enter__()
    except Exception as e:  # the reason is what matters here, whatever failed
        unavailable(f"no Kafka-protocol broker: {e}")
        return
    try:
        cert, key = certificates.server
        with TlsProxy(port, int(plain.rsplit(":", 1)[1]), cert, key) as proxy:
            yield TlsBroker(proxy, f"127.0.0.1:{port}")
    finally:
        broker.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tls_broker(certificates: Certificates) -> Iterator[TlsBroker]:
    """Tansu reachable over TLS only (its plain port is advertised nowhere)."""
    yield from _tls_broker(certificates)


@pytest.fixture(scope="module")
def sasl_broker(certificates: Certificates) -> Iterator[TlsBroker]:
    """Tansu with ``--authentication`` (SASL SCRAM required), over TLS."""
    yield from _tls_broker(certificates, ("--authentication",))


def refused_start(tmp_path: Path, env: dict[str, str], *flags: str) -> tuple[str, str]:
    """The one ``rolloutlog serve:`` line of a start that failed, and everything it wrote."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolloutlog.api.cli",
            "serve",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            str(free_port()),
            *flags,
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    output = done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("rolloutlog serve:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0], output
