"""The open-file limit and the connection cap, against a real ``rolloutlog serve``.

- Started with a low soft open-file limit, the service raises it to the hard one (and says so in
  one log line), and serves more connections than the soft limit allowed.
- Started with soft and hard limits of 1,024 (the common default, nothing to raise), 1,100
  connections that open and say nothing leave ``/healthz``, ``/readyz`` and a trainer's
  checkpoint a way in (the reserve), refuse other requests with ``503 unavailable`` rather than
  resetting them, never take the service to its descriptor limit, and once they go, appends go
  through again. Before the cap, ``/healthz`` got connection resets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.faults._api import (
    Served,
    append,
    append_when_served,
    create_run,
    envelope,
    register,
    serve,
    take_over,
)

RUN = "capped"
NOFILE = resource.RLIMIT_NOFILE
#: The flood: more connections than the service's whole descriptor limit.
FLOOD = 1100
FLOOD_LIMIT = 1024
#: A probe through the reserve answers within this (the flood is open and silent by then; a
#: loaded machine's scheduling; measured well under a second on a quiet one).
PROBE_WITHIN_S = 15.0
#: Appends go through again within this of the flood's end (measured ~0.1 s on a quiet machine).
APPENDS_BACK_WITHIN_S = 15.0


@contextlib.contextmanager
def descriptors(needed: int) -> Iterator[None]:
    """This process's soft open-file limit raised to ``needed`` for the test (skip if the hard
    limit is below it)."""
    soft, hard = resource.getrlimit(NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this test needs {needed} open files; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(NOFILE, (soft, hard))


def _service_descriptors(served: Served) -> int:
    return len(os.listdir(f"/proc/{served.proc.pid}/fd"))


def _open_files(served: Served) -> tuple[int, int]:
    """The service's soft and hard open-file limits, as it runs."""
    for line in Path(f"/proc/{served.proc.pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc/PID/limits")


async def _healthz(url: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_WITHIN_S) as client:
        return await client.get("/healthz")


async def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    soft = 128
    _, hard = resource.getrlimit(NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("an unlimited hard open-file limit: the service asks for 2^20")
    connections = 3 * soft
    with descriptors(connections + 128):
        if hard < connections * 2:
            pytest.skip(f"the hard open-file limit {hard} is too low to serve past {soft}")
        limits = {NOFILE: (soft, hard)}
        async with serve(tmp_path, "--log-level", "info", limits=limits) as served:
            assert _open_files(served) == (hard, hard)
            [line] = [
                orjson.loads(line)
                for line in served.output.read_text().splitlines()
                if "open-file limit" in line
            ]
            assert line["message"].startswith(f"open-file limit raised from {soft} to {hard}")
            assert (line["nofile_before"], line["nofile"]) == (soft, hard)
            assert line["max_connections"] == hard // 2

            # Three times the soft limit it started with, open at once, each served.
            pool = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
            async with httpx.AsyncClient(base_url=served.url, limits=pool, timeout=60) as client:
                gate = asyncio.Event()

                async def hold() -> int:
                    async with client.stream("GET", "/healthz") as response:
                        await gate.wait()  # every connection open at once
                        await response.aread()
                        return response.status_code

                holders = [asyncio.create_task(hold()) for _ in range(connections)]
                deadline = time.monotonic() + 60
                while _service_descriptors(served) < connections:
                    assert time.monotonic() < deadline, _service_descriptors(served)
                    await asyncio.sleep(0.1)
                gate.set()
                assert await asyncio.gather(*holders) == [200] * connections
            assert served.alive()


def _flood(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that open and say nothing."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        socks.append(sock)
    return socks


async def test_a_flood_of_silent_connections_leaves_health_checks_and_trainers_a_way_in(
    tmp_path: Path,
) -> None:
    # Headers may take 10 minutes: the flood holds its connections until the test drops them.
    flags = ("--header-timeout", "600")
    limits = {NOFILE: (FLOOD_LIMIT, FLOOD_LIMIT)}
    with descriptors(FLOOD + 256):
        async with (
            serve(tmp_path, *flags, limits=limits) as served,
            httpx.AsyncClient(base_url=served.url, timeout=60) as client,
        ):
            await create_run(client, RUN)
            await register(client, RUN)
            epoch = await take_over(client, RUN)
            response = await append(client, RUN, [envelope("e1", 1, type_="episode.started")])
            assert response.status_code == 200, response.text
            await client.aclose()  # its connection is not one of the service's from now on

            flood = await asyncio.to_thread(_flood, served.port, FLOOD)
            try:
                # Never at the descriptor limit (the cap is half of it: 512).
                assert _service_descriptors(served) < FLOOD_LIMIT * 3 // 4
                started = time.monotonic()
                assert (await _healthz(served.url)).status_code == 200
                print(f"/healthz answered in {time.monotonic() - started:.3f} s under the flood")
                assert time.monotonic() - started < PROBE_WITHIN_S
                async with httpx.AsyncClient(base_url=served.url, timeout=60) as probe:
                    assert (await probe.get("/readyz")).status_code == 200
                    body = {"controller_epoch": epoch, "wait": True}
                    reply = await probe.post(f"/v1/runs/{RUN}/checkpoints", json=body)
                    assert reply.status_code == 201, reply.text
                    assert reply.json()["status"] == "committed", reply.text
                    # Not a reserved route: refused, retriable, not reset.
                    refused = await append(probe, RUN, [envelope("e1", 2)])
                    assert refused.status_code == 503, refused.text
                    assert refused.json()["error"]["code"] == "unavailable"
                    assert refused.headers["retry-after"] == "1"
                    assert (await probe.get("/metrics")).status_code == 503  # not reserved
                assert _service_descriptors(served) < FLOOD_LIMIT * 3 // 4
            finally:
                for sock in flood:
                    sock.close()

            # The flood goes: appends are served again, within a bound.
            gone = time.monotonic()
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
                events = [envelope("e1", 2)]
                took = await append_when_served(
                    client, served, RUN, events, gone, APPENDS_BACK_WITHIN_S
                )
                print(f"appends back {took:.2f} s after the flood went")
                assert (await client.get("/metrics")).status_code == 200
            assert served.alive()
