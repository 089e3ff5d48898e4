"""Slow clients against a real ``rolloutlog serve`` (timeouts set short): a connection that sends
nothing, half its headers, or a body that never finishes is answered ``408`` and closed within
the timeout while other requests are served; a body that keeps coming is not cut off; appends
beyond ``--max-inflight-appends`` are refused with ``503 unavailable`` and the service recovers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson

from tests.faults._api import (
    append,
    closed_within,
    create_run,
    envelope,
    raw_connection,
    register,
    serve,
)

RUN = "slow"
TIMEOUT_S = 1.0
#: Generous: the timeout plus scheduling on a loaded machine.
CLOSED_WITHIN_S = 8.0


def _post_head(port: int, length: int) -> bytes:
    return (
        f"POST /v1/runs/{RUN}/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def test_stalled_headers_and_bodies_are_cut_off_while_others_are_served(
    tmp_path: Path,
) -> None:
    flags = ("--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S))
    async with serve(tmp_path, *flags) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        await register(client, RUN)
        body = orjson.dumps([envelope("e1", 1, type_="episode.started")])
        silent = raw_connection(served.port, b"")
        half_headers = raw_connection(served.port, b"POST /v1/runs/slow/events HTTP/1.1\r\nHo")
        half_body = raw_connection(served.port, _post_head(served.port, len(body)) + body[:10])
        started = time.monotonic()
        # Served meanwhile.
        assert (await client.get("/healthz")).status_code == 200
        response = await append(client, RUN, [envelope("e1", 2)])
        assert response.status_code == 200, response.text

        results = await asyncio.gather(
            *(
                asyncio.to_thread(closed_within, sock, CLOSED_WITHIN_S)
                for sock in (silent, half_headers, half_body)
            )
        )
        for sock, (closed, received) in zip(
            (silent, half_headers, half_body), results, strict=True
        ):
            sock.close()
            assert closed, received
            assert received.startswith(b"HTTP/1.1 408"), received
            assert b"request_timeout" in received, received
        assert time.monotonic() - started >= TIMEOUT_S * 0.9

        # A body that keeps arriving (each piece within the timeout) is not cut off.
        steady = orjson.dumps([envelope("e1", 3)])
        sock = raw_connection(served.port, _post_head(served.port, len(steady)))
        for piece in (steady[:20], steady[20:40], steady[40:]):
            await asyncio.sleep(TIMEOUT_S * 0.6)
            sock.sendall(piece)
        sock.settimeout(5)
        reply = sock.recv(65536)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert served.alive()


async def _inflight(client: httpx.AsyncClient) -> float:
    metrics = (await client.get("/metrics")).text
    [line] = [
        line for line in metrics.splitlines() if line.startswith("rolloutlog_inflight_appends ")
    ]
    return float(line.split()[1])


async def test_appends_beyond_the_in_flight_bound_get_503_and_the_service_recovers(
    tmp_path: Path,
) -> None:
    flags = ("--max-inflight-appends", "2", "--body-timeout", "30")
    async with serve(tmp_path, *flags) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        await register(client, RUN)
        body = orjson.dumps([envelope("e1", 1, type_="episode.started")])
        # Two appends whose bodies stall hold both slots.
        holders = [
            raw_connection(served.port, _post_head(served.port, len(body)) + body[:10])
            for _ in range(2)
        ]
        deadline = time.monotonic() + 10
        while await _inflight(client) < 2:
            assert time.monotonic() < deadline, served.tail()
            await asyncio.sleep(0.05)
        started = time.monotonic()
        refused = await append(client, RUN, [envelope("e1", 1, type_="episode.started")])
        assert refused.status_code == 503, refused.text
        assert time.monotonic() - started < 2.0  # refused at once, not queued
        assert refused.json()["error"]["code"] == "unavailable"
        assert refused.headers["retry-after"] == "1"
        assert (await client.get("/healthz")).status_code == 200

        for sock in holders:  # the stalled clients go away: their slots are released
            sock.close()
        deadline = time.monotonic() + 10
        while True:
            response = await append(client, RUN, [envelope("e1", 2)])
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert response.status_code == 200, response.text
        assert served.alive()
