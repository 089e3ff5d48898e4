"""The service's edges in-process: the connection cap's arithmetic, the routes its reserve
serves, the body timeout's minimum rate and which slow body gives its append slot up (against
real servers: tests/faults/test_slow_clients.py and test_connection_cap.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.exceptions import HTTPException

from rolloutlog.api._app import BodyTimeout
from rolloutlog.api._bodies import EVICTABLE_AFTER_S, BodyMeter, slowest
from rolloutlog.api._protocol import (
    MAX_BACKLOG,
    MIN_BACKLOG,
    ConnectionCap,
    connection_cap,
    reserved,
)


def test_the_cap_is_half_the_open_file_limit_with_a_reserve_and_a_backlog_below_the_rest() -> None:
    assert connection_cap(1024, None, 32) == ConnectionCap(512, 32, 128)
    assert connection_cap(1 << 20, None, 32) == ConnectionCap(1 << 19, 32, MAX_BACKLOG)
    assert connection_cap(1024, 1000, 32) == ConnectionCap(1000, 32, MIN_BACKLOG)
    # The reserve is at most a quarter of the cap.
    assert connection_cap(64, None, 32) == ConnectionCap(32, 8, MIN_BACKLOG)
    assert connection_cap(1024, 300, 0).unreserved == 300


@pytest.mark.parametrize(
    ("target", "kept"),
    [
        (b"/healthz", True),
        (b"/readyz?verbose=1", True),
        (b"/v1/runs/r1/checkpoints", True),
        (b"/v1/runs/r1/checkpoints/latest", True),
        (b"/v1/runs/r1/checkpoints/7/manifest?x=1", True),
        (b"/v1/runs/r1/restores/3/projections", True),
        (b"/v1/runs/r1/controller", True),
        (b"/v1/runs/r1/events", False),
        (b"/v1/runs/r1", False),
        (b"/v1/runs", False),
        (b"/metrics", False),
        (b"/healthz/x", False),
        (b"/v1/runs/r1/checkpointsx", False),
        (b"/v1/runs/a/b/checkpoints", False),
    ],
)
def test_the_reserve_serves_health_checks_and_the_trainers_routes(
    target: bytes, kept: bool
) -> None:
    assert reserved(target) is kept


async def _read_all(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass


def _body(every_s: float, chunk: bytes, chunks: int) -> Any:
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        await asyncio.sleep(every_s)
        sent += 1
        return {"type": "http.request", "body": chunk, "more_body": sent < chunks}

    return receive


async def _nothing(message: Any) -> None:
    raise AssertionError("nothing is sent")


async def test_a_body_below_the_minimum_rate_is_refused_after_the_grace() -> None:
    # A byte every 20 ms never stalls (timeout 0.2 s) but averages 50 bytes/s: below 200.
    middleware = BodyTimeout(_read_all, timeout_s=0.2, min_rate=200)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(HTTPException) as refused:
        await middleware({"type": "http"}, _body(0.02, b"x", 1000), _nothing)
    assert refused.value.status_code == 408
    assert "below the minimum of 200 bytes/s" in str(refused.value.detail)
    assert 0.2 <= loop.time() - started < 2.0

    # Steady above the minimum: served whole, however long it takes past the grace.
    middleware = BodyTimeout(_read_all, timeout_s=0.2, min_rate=200)
    await middleware({"type": "http"}, _body(0.02, b"x" * 10, 20), _nothing)  # 500 bytes/s
    # No minimum: only a stall is refused.
    middleware = BodyTimeout(_read_all, timeout_s=0.2, min_rate=0)
    await middleware({"type": "http"}, _body(0.02, b"x", 20), _nothing)
    with pytest.raises(HTTPException) as stalled:
        await middleware({"type": "http"}, _body(0.3, b"x", 2), _nothing)
    assert "no part of the request body arrived for 0.2 s" in str(stalled.value.detail)


async def test_only_the_time_spent_waiting_for_the_body_counts() -> None:
    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            await asyncio.sleep(0.05)  # the app's own work between reads
            if not (await receive()).get("more_body"):
                return

    # Each byte is waited for 10 ms and the app spends 50 ms on it: over the 1.2 s the body
    # takes that is 17 bytes/s, below the minimum; but the client sent 100 bytes/s while it
    # was waited for.
    middleware = BodyTimeout(slow_app, timeout_s=0.2, min_rate=50)
    await middleware({"type": "http"}, _body(0.01, b"x", 20), _nothing)


def test_the_slot_given_up_is_the_slowest_body_waited_for_long_enough() -> None:
    def meter(received: int, waited: float, waiting: bool = True) -> BodyMeter:
        m = BodyMeter()
        m.received, m.waited = received, waited
        if waiting:
            m.start(100.0, object())  # type: ignore[arg-type]
        return m

    now = 100.0
    fresh = meter(0, EVICTABLE_AFTER_S / 2)  # not waited for long enough
    fast = meter(50_000, 5.0)  # 10,000 bytes/s: above the minimum
    slow = meter(20, 5.0)  # 4 bytes/s
    slower = meter(2, 5.0)  # 0.4 bytes/s
    busy = meter(0, 9.0, waiting=False)  # the app is working on its parts: not waiting
    assert slowest([fresh, fast, slow, slower, busy], 4096, now) is slower
    assert slowest([fresh, fast, slow], 4096, now) is slow
    assert slowest([fresh, fast, busy], 4096, now) is None
    assert slowest([slow], 1, now) is None  # not below a minimum of 1 byte/s
    fresh.stop(now + EVICTABLE_AFTER_S)
    assert fresh.waited == EVICTABLE_AFTER_S * 1.5 and fresh.since is None
