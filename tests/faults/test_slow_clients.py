"""Slow clients against a real ``rolloutlog serve`` (timeouts set short): a connection that sends
nothing, half its headers, or a body that never finishes is answered ``408`` and closed within
the timeout while other requests are served; a body that keeps coming is not cut off, but one
trickled below ``--min-body-rate`` is, and frees its append slot; appends beyond
``--max-inflight-appends`` are refused with ``503 unavailable`` and the service recovers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson

from tests.faults._api import (
    append,
    append_when_served,
    closed_within,
    create_run,
    envelope,
    raw_connection,
    register,
    serve,
    trickle,
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
    # The steady body below sends ~33 bytes/s: above this minimum rate.
    flags = ("--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S))
    flags += ("--min-body-rate", "10")
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
    # No minimum body rate: the stalled holders keep their slots (else a newcomer takes one).
    flags = ("--max-inflight-appends", "2", "--body-timeout", "30", "--min-body-rate", "0")
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
        await append_when_served(client, served, RUN, [envelope("e1", 2)], time.monotonic(), 10)
        assert served.alive()


#: Slow-loris clients: more than ``--max-inflight-appends`` (64) of them, each opening a new
#: connection as soon as the service closes its last.
TRICKLERS = 70
TRICKLE_EVERY_S = 1.0
#: The grace (``--body-timeout``): above the trickle's interval, so a trickle never stalls.
GRACE_S = 3.0
#: Appends from a normal client among them.
APPENDS = 5
#: Each is served within this of its first attempt (a trickle's slot is taken once it has been
#: waited for 1 s; then scheduling 70 clients on a loaded machine; measured ~1 s on a quiet one).
APPEND_WITHIN_S = 15.0


async def test_trickled_bodies_are_cut_off_and_appends_get_their_slots(tmp_path: Path) -> None:
    # A byte every second never stalls (--body-timeout is 3 s): before the minimum rate, 64 such
    # bodies held every append slot for good and every other append was refused.
    flags = ("--body-timeout", str(GRACE_S), "--min-body-rate", "1000")
    async with serve(tmp_path, *flags) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        await register(client, RUN)
        assert (await append(client, RUN, [envelope("e1", 1, type_="episode.started")])).is_success
        # A body the app answers without reading is read on for the header timeout at most.
        unread = raw_connection(
            served.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n "
        )
        head = _post_head(served.port, 10_000)
        # One slow client alone: refused at the end of its grace.
        stop = asyncio.Event()
        replies: list[tuple[bytes, float]] = []
        alone = asyncio.create_task(trickle(served.port, head, TRICKLE_EVERY_S, stop, replies))
        deadline = time.monotonic() + GRACE_S + CLOSED_WITHIN_S
        while not replies:
            assert time.monotonic() < deadline, served.tail()
            await asyncio.sleep(0.1)
        stop.set()
        await alone
        [(reply, held_s)] = replies
        assert reply.startswith(b"HTTP/1.1 408") and b"(after the first 3 s)" in reply, reply
        assert GRACE_S * 0.9 <= held_s < GRACE_S + CLOSED_WITHIN_S

        # Seventy, each opening a new connection as soon as its last is closed.
        stop = asyncio.Event()
        replies = []
        tricklers = [
            asyncio.create_task(trickle(served.port, head, TRICKLE_EVERY_S, stop, replies))
            for _ in range(TRICKLERS)
        ]
        try:
            deadline = time.monotonic() + 10
            while await _inflight(client) < 64:
                assert time.monotonic() < deadline, served.tail()
                await asyncio.sleep(0.05)
            # A normal client retries its refused appends (as the SDK does): each is served.
            for seq in range(2, 2 + APPENDS):
                events = [envelope("e1", seq)]
                began = time.monotonic()
                took = await append_when_served(client, served, RUN, events, began, APPEND_WITHIN_S)
                print(f"append {seq} served {took:.2f} s after its first attempt")
                assert (await client.get("/healthz")).status_code == 200
        finally:
            stop.set()
            await asyncio.gather(*tricklers)
        closed, answered = await asyncio.to_thread(closed_within, unread, CLOSED_WITHIN_S + 10)
        unread.close()
        assert closed and answered.startswith(b"HTTP/1.1 200"), answered

        statuses = {reply[:12] for reply, _ in replies}
        assert statuses <= {b"HTTP/1.1 408", b"HTTP/1.1 503"}, statuses
        timed_out = [reply for reply, _ in replies if reply.startswith(b"HTTP/1.1 408")]
        assert all(b'"code":"request_timeout"' in reply for reply in timed_out)
        # Past the grace, or sooner: their slots taken by other appends (theirs and the client's).
        assert any(b"went to another append" in reply for reply in timed_out), replies[:3]
        held = max(seconds for _, seconds in replies)
        assert held < GRACE_S + CLOSED_WITHIN_S, held  # none held a slot for good
        deadline = time.monotonic() + 10
        while await _inflight(client) > 0:  # every slot back
            assert time.monotonic() < deadline, served.tail()
            await asyncio.sleep(0.1)
        assert served.alive()
