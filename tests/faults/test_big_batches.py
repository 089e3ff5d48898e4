"""A 32 MiB batch of tiny events does not stall the service: while a real ``rolloutlog serve``
validates and appends it, and then while its projector applies it, ``/healthz`` keeps answering
quickly (the bound is generous; the figures are in the commits that sliced the work), and the
batch is acknowledged whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import orjson
import pytest

from tests.faults._api import create_run, envelope, register, serve, take_over

RUN = "big"
BODY_BYTES = 32 * 1024 * 1024 - 4096
#: Generous: the goal is ~100 ms on a quiet machine; this one is shared.
HEALTHZ_WITHIN_S = 1.0


def _big_body() -> tuple[bytes, int]:
    """A JSON array of tiny events (one participant epoch, seqs 1, 2, …) just under 32 MiB."""
    one = orjson.dumps(envelope("e0", 1, type_="step.started"))
    count = BODY_BYTES // (len(one) + 8)
    events = [
        envelope(f"e{seq % 1000}", seq, type_="step.started", stage="s")
        for seq in range(1, count + 1)
    ]
    body = orjson.dumps(events)
    assert len(body) <= BODY_BYTES, len(body)
    return body, count


Work = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]


class Probe(NamedTuple):
    started: float
    latency_s: float


def _append(body: bytes) -> Work:
    async def post(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(
            f"/v1/runs/{RUN}/events", content=body, headers={"Content-Type": "application/json"}
        )

    return post


async def _probe_while(served_url: str, work: Work) -> tuple[httpx.Response, list[Probe]]:
    """Do ``work`` (requests on a client of its own) and probe ``/healthz`` until it is done:
    each probe's start (``time.perf_counter``) and latency."""

    async def working() -> httpx.Response:
        async with httpx.AsyncClient(base_url=served_url, timeout=240) as own:
            return await work(own)

    appending = asyncio.create_task(working())
    probes = []
    async with httpx.AsyncClient(base_url=served_url, timeout=30) as client:
        while not appending.done():
            started = time.perf_counter()
            assert (await client.get("/healthz")).status_code == 200
            probes.append(Probe(started, time.perf_counter() - started))
            await asyncio.sleep(0.02)
    return await appending, probes


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_healthz_answers_while_a_32_mib_batch_is_validated(tmp_path: Path) -> None:
    body, count = _big_body()
    # The last envelope lacks its data: the whole batch is parsed and validated, then refused.
    refused_body = body[: body.rindex(b',"data":')] + b"}]"
    async with serve(tmp_path) as served, httpx.AsyncClient(base_url=served.url) as client:
        await create_run(client, RUN)
        await register(client, RUN)

        refused, probes = await _probe_while(served.url, _append(refused_body))
        latencies = [probe.latency_s for probe in probes]
        assert refused.status_code == 422, refused.text[:500]
        error = refused.json()["error"]
        assert (error["code"], error["details"]["index"]) == ("invalid_event", count - 1)
        assert len(latencies) > 10, latencies  # validation took a while: /healthz was probed
        print(f"{count} events, {len(body)} bytes: /healthz max {max(latencies) * 1000:.0f} ms")
        assert max(latencies) < HEALTHZ_WITHIN_S, sorted(latencies)[-5:]

        # The same batch, valid, is acknowledged whole. The projector applies its records as
        # they are committed (from the log's in-memory tail) and then the rest a page (up to
        # 8 MiB) at a time; a checkpoint waits until it has applied them all.
        epoch = await take_over(client, RUN)
        acknowledged_at: list[float] = []

        async def append_then_checkpoint(own: httpx.AsyncClient) -> httpx.Response:
            accepted = await _append(body)(own)
            assert accepted.status_code == 200, accepted.text[:500]
            assert len(accepted.json()["offsets"]) == count
            acknowledged_at.append(time.perf_counter())
            checkpoint = await own.post(
                f"/v1/runs/{RUN}/checkpoints", json={"controller_epoch": epoch}
            )
            return checkpoint

        checkpoint, probes = await _probe_while(served.url, append_then_checkpoint)
        assert checkpoint.status_code == 201, checkpoint.text[:500]
        latencies = [probe.latency_s for probe in probes]
        after_ack = [p.latency_s for p in probes if p.started >= acknowledged_at[0]]
        # Validation, the commit and the fold took a while: /healthz was probed throughout,
        # and at least once between the acknowledgement and the checkpoint's commit (which
        # waited for the projector to apply every record).
        assert len(latencies) > 10 and after_ack, (latencies, after_ack)
        print(
            f"while it is appended and applied: /healthz max {max(latencies) * 1000:.0f} ms "
            f"({len(after_ack)} probes after the acknowledgement)"
        )
        assert max(latencies) < HEALTHZ_WITHIN_S, sorted(latencies)[-5:]
        assert served.alive()
