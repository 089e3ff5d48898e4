"""The PostgreSQL catalog over TLS, for real: a throwaway cluster (``tests/faults/_postgres``)
with ``ssl = on``, a server certificate for ``localhost`` signed by the test CA, and a
``pg_hba.conf`` that takes TLS connections only. The catalog URL's ``sslmode`` and
``sslrootcert`` decide what is checked; a certificate that does not check out is refused in
one line. The machine's own cluster (5432) is never touched."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest

from rolloutlog.api import Settings, Tokens
from rolloutlog.catalog import open_catalog
from rolloutlog.errors import RolloutlogError
from tests.api.conftest import TOKENS, open_api
from tests.faults._postgres import PostgresCluster, postgres_cluster
from tests.security.conftest import Certificates, refused_start

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def tls_cluster(certificates: Certificates) -> Iterator[PostgresCluster]:
    with postgres_cluster() as cluster:
        cert, key = certificates.localhost
        for source, name in ((cert, "server.crt"), (key, "server.key")):
            target = cluster.data / name
            shutil.copy(source, target)
            target.chmod(0o600)
            if os.geteuid() == 0:
                user = cluster.data.stat()
                os.chown(target, user.st_uid, user.st_gid)
        with open(cluster.data / "postgresql.conf", "a") as conf:
            conf.write("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n")
        (cluster.data / "pg_hba.conf").write_text(
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n"
        )
        assert cluster.proc is not None
        os.kill(cluster.proc.pid, signal.SIGHUP)  # ssl and pg_hba.conf are reloadable
        _wait_for_tls(cluster)
        yield cluster


def _wait_for_tls(cluster: PostgresCluster) -> None:
    deadline = time.monotonic() + 20
    while True:
        done = subprocess.run(
            [
                str(cluster.binaries / "psql"),
                "-Atc",
                "SHOW ssl",
                f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres sslmode=require",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.stdout.strip() == "on":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the cluster did not turn TLS on: {done.stderr}{cluster.tail()}")
        time.sleep(0.1)


def _url(cluster: PostgresCluster, host: str, query: str) -> str:
    return f"postgresql+asyncpg://postgres@{host}:{cluster.port}/postgres?{query}"


async def _ssl_in_use(url: str) -> bool:
    catalog = open_catalog(url)
    async with catalog:
        await catalog.list_runs(limit=1)  # migrated and read, over this connection's TLS
    dsn = url.replace("postgresql+asyncpg://", "postgresql://").split("?")[0]
    conn = await asyncpg.connect(dsn, ssl="require")
    try:
        return bool(await conn.fetchval("SELECT bool_and(ssl) FROM pg_stat_ssl"))
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("host", "query"),
    [
        ("localhost", "sslmode=verify-full&sslrootcert={ca}"),
        ("127.0.0.1", "sslmode=verify-ca&sslrootcert={ca}"),
        ("127.0.0.1", "sslmode=require"),
    ],
)
async def test_the_catalog_runs_over_tls(
    tls_cluster: PostgresCluster, certificates: Certificates, host: str, query: str
) -> None:
    url = _url(tls_cluster, host, query.format(ca=certificates.ca.cert))
    assert await _ssl_in_use(url)


async def test_the_cluster_takes_no_plain_connection(tls_cluster: PostgresCluster) -> None:
    catalog = open_catalog(_url(tls_cluster, "127.0.0.1", "sslmode=disable"))
    with pytest.raises(RolloutlogError) as refused:
        await catalog.start()
    assert "no encryption" in refused.value.message


@pytest.mark.parametrize(
    ("host", "query", "cause"),
    [
        (
            "127.0.0.1",
            "sslmode=verify-ca&sslrootcert={wrong}",
            "certificate verify failed: unable to get local issuer certificate",
        ),
        (
            "127.0.0.1",
            "sslmode=verify-full&sslrootcert={ca}",
            "certificate verify failed: IP address mismatch, certificate is not valid for '127.0.0.1'",
        ),
    ],
)
async def test_a_certificate_that_does_not_check_out_is_refused_in_one_line(
    tls_cluster: PostgresCluster, certificates: Certificates, host: str, query: str, cause: str
) -> None:
    url = _url(
        tls_cluster,
        host,
        query.format(ca=certificates.ca.cert, wrong=certificates.wrong_ca.cert),
    )
    catalog = open_catalog(url)
    with pytest.raises(RolloutlogError) as refused:
        await catalog.start()
    message = refused.value.message
    assert cause in message, message
    assert "\n" not in message


def test_serve_refuses_a_catalog_with_a_wrong_ca_in_one_line(
    tls_cluster: PostgresCluster, certificates: Certificates, tmp_path: Path
) -> None:
    url = _url(
        tls_cluster, "localhost", f"sslmode=verify-full&sslrootcert={certificates.wrong_ca.cert}"
    ).replace("postgres@", "postgres:hunter2@")
    line, output = refused_start(tmp_path, {"ROLLOUTLOG_CATALOG_URL": url})
    assert "certificate verify failed: unable to get local issuer certificate" in line
    assert "://postgres:***@localhost:" in line
    assert "hunter2" not in output


async def test_no_password_in_a_log_record_or_readyz_when_the_catalog_goes_down(
    tls_cluster: PostgresCluster,
    certificates: Certificates,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The catalog URL's password (the cluster trusts, so any password connects) stays out of
    every log record (their extra fields too) and of ``/readyz``'s body, up and down."""
    url = _url(
        tls_cluster, "localhost", f"sslmode=verify-full&sslrootcert={certificates.ca.cert}"
    ).replace("postgres@", "postgres:hunter2@")
    settings = Settings(
        data_dir=tmp_path / "data", catalog_url=url, tokens=Tokens.from_mapping(TOKENS, "test")
    )
    caplog.set_level(logging.DEBUG)
    async with open_api(settings) as api:
        ready = await api.client.get("/readyz")
        assert ready.status_code == 200, ready.text
        tls_cluster.kill()
        try:
            down = await api.client.get("/readyz")
            assert down.status_code == 503
            assert "catalog" in down.json()["checks"] and "hunter2" not in down.text
        finally:
            tls_cluster.start()
    assert caplog.records
    for record in caplog.records:
        assert "hunter2" not in f"{record.getMessage()} {record.__dict__}", record
