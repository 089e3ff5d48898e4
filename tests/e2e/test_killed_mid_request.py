"""A participant SIGKILLed in the middle of an append request: the request is all or nothing, so
none of its events, not even the complete lines already received, reach the log."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from rolloutlog.trainer import AsyncTrainerClient
from tests import factories as f
from tests.api.conftest import TOKENS, wire
from tests.e2e._harness import Service, kill_group
from tests.e2e.conftest import RUN

pytestmark = pytest.mark.slow

#: Sends the request in the file named by argv[2] to port argv[1], then waits to be killed.
SENDER = """
import socket, sys
request = open(sys.argv[2], "rb").read()
connection = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
connection.sendall(request)
sys.stdin.read()
"""


def append_request(service: Service, body: bytes, announced: int) -> bytes:
    head = (
        f"POST /v1/runs/{RUN}/events HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{service.port}\r\n"
        f"Authorization: Bearer {TOKENS['participant']}\r\n"
        "Content-Type: application/x-ndjson\r\n"
        f"Content-Length: {announced}\r\n\r\n"
    )
    return head.encode() + body


def start_sender(service: Service, request: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", SENDER, str(service.port), str(request)],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


async def inflight_appends(service: Service) -> int:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{service.url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("rolloutlog_inflight_appends"):
            return int(float(line.split()[-1]))
    raise AssertionError("no rolloutlog_inflight_appends in /metrics")


async def until_inflight(service: Service, count: int) -> None:
    deadline = time.monotonic() + 30
    while await inflight_appends(service) != count:
        assert time.monotonic() < deadline, f"in-flight appends never reached {count}"
        await asyncio.sleep(0.02)


async def test_a_participant_killed_mid_request_appends_nothing(
    service: Service, trainer: AsyncTrainerClient, tmp_path: Path
) -> None:
    await trainer.register_participant(RUN, "env-0", "environment")
    lines = b"".join(
        orjson.dumps(event) + b"\n"
        for event in wire(f.started("k0"), f.boundary("k0", "seed", {"turn": 1}))
    )
    # Two whole NDJSON lines and the start of a third; the rest never comes.
    partial = lines + b'{"v": 1, "type": "step.bou'
    request = tmp_path / "request.bin"
    request.write_bytes(append_request(service, partial, len(partial) + 200))
    sender = start_sender(service, request)
    try:
        await until_inflight(service, 1)  # the service is reading the body
    finally:
        kill_group(sender)
        assert sender.stdin is not None
        sender.stdin.close()
    assert sender.returncode == -9
    await until_inflight(service, 0)  # the service saw the connection end

    checkpoint = await trainer.checkpoint(RUN)
    assert dict(checkpoint.counts) == {"continue": 0, "restart": 0, "finished": 0}

    # The control: the same lines in a whole request are appended.
    async with httpx.AsyncClient(timeout=30) as client:
        whole = await client.post(
            f"{service.url}/v1/runs/{RUN}/events",
            content=lines,
            headers={
                "Authorization": f"Bearer {TOKENS['participant']}",
                "Content-Type": "application/x-ndjson",
            },
        )
    assert whole.status_code == 200, whole.text
    after = await trainer.checkpoint(RUN)
    assert dict(after.counts) == {"continue": 1, "restart": 0, "finished": 0}
