"""Health across replicas: three ``rolloutlog serve`` replicas on one Kafka (Tansu) log and one
PostgreSQL catalog. One replica is held back for real (its event loop kept busy through the
fault tests' hook, or its process SIGSTOPped); every other replica's ``/readyz`` body and
``GET /v1/runs/{run}`` name the partitions and the replica that hold the run back, while their
status codes stay their own readiness. A busy replica keeps its partitions (the heartbeat has a
thread of its own); a stopped one loses them within its lease, and the run is healthy again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import REPLICA_LEASE_S, Deployment, Replica, Replicas
from tests.e2e.conftest import KAFKA_ONLY

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, KAFKA_ONLY]

RUN = "health"
PARTITIONS = 6
HEADERS = {"Authorization": f"Bearer {TOKENS['admin']}"}


@pytest.fixture
async def three(
    deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Replicas]:
    monkeypatch.setenv("ROLLOUTLOG_TEST_HOOKS", "1")  # POST /_test/block-loop
    replicas = Replicas(deployment, tmp_path, 3)
    try:
        await replicas.start()
        client = AsyncTrainerClient(replicas.members[0].url, token=TOKENS["admin"], timeout_s=60)
        try:
            await client.create_run(RUN, partitions=PARTITIONS)
        finally:
            await client.stop()
        await replicas.catalog.wait_owned(RUN, PARTITIONS, {"r1", "r2", "r3"})
        yield replicas
    finally:
        replicas.stop()


async def health(client: httpx.AsyncClient, replica: Replica) -> tuple[int, dict[str, Any], dict]:
    """``(readyz status code, readyz's view of the run, GET /v1/runs/{run}'s health)``."""
    ready = await client.get(f"{replica.url}/readyz")
    run = await client.get(f"{replica.url}/v1/runs/{RUN}", headers=HEADERS)
    assert run.status_code == 200, run.text
    return ready.status_code, ready.json()["runs"].get(RUN, {}), run.json()["health"]


def named(view: dict[str, Any], replica: str, partitions: set[int]) -> dict[int, str]:
    """The states of ``partitions`` that ``view`` says ``replica`` holds back."""
    return {
        b["partition"]: b["state"]
        for b in view.get("held_back", [])
        if b["replica"] == replica and b["partition"] in partitions
    }


async def wait_healthy(
    client: httpx.AsyncClient, replicas: list[Replica], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        views = [await health(client, r) for r in replicas]
        if all(code == 200 and run["status"] == "ok" for code, run, _ in views) and all(
            h["status"] == "ok" and not h["held_back"] for _, _, h in views
        ):
            return
        assert time.monotonic() < deadline, f"the run did not become healthy again: {views}"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(180)
async def test_a_busy_replica_keeps_its_partitions_and_the_others_name_it(
    three: Replicas,
) -> None:
    """r3's event loop is kept busy for four leases: its heartbeat goes on (no partition moves,
    no generation changes), and r1 and r2 both say, in ``/readyz`` (still 200) and in the run's
    view, which of r3's partitions hold the run back and that r3 does not answer."""
    r1, r2, r3 = three.members
    before = await three.catalog.leases(RUN)
    mine = {p for p, (owner, _) in before.items() if owner == "r3"}
    assert mine
    blocked_s = 4 * REPLICA_LEASE_S
    async with httpx.AsyncClient(timeout=30) as client:
        await wait_healthy(client, [r1, r2], timeout_s=30)
        block = asyncio.create_task(
            client.post(f"{r3.url}/_test/block-loop", params={"seconds": blocked_s})
        )
        started = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < 2:
            for other in (r1, r2):
                code, ready, run = await health(client, other)
                assert code == 200, ready  # its own readiness: it is ready
                if (
                    named(ready, "r3", mine) == dict.fromkeys(mine, "unresponsive")
                    and named(run, "r3", mine) == dict.fromkeys(mine, "unresponsive")
                    and run["status"] == "degraded"
                    and run["local"]["status"] == "ok"
                ):
                    seen.setdefault(other.replica_id, time.monotonic() - started)
            assert time.monotonic() - started < blocked_s, f"r3 was not named: {ready} {run}"
            await asyncio.sleep(0.1)
        # Named within half a lease of silence plus a heartbeat and a report's period.
        assert max(seen.values()) < REPLICA_LEASE_S * 1.5 + 2, seen
        blocker = next(b for b in run["held_back"] if b["replica"] == "r3")
        assert "event loop has not answered" in blocker["reason"], blocker
        while not block.done():  # the whole block long, nothing moves
            assert await three.catalog.leases(RUN) == before
            await asyncio.sleep(0.5)
        assert (await block).status_code == 200
        assert time.monotonic() - started >= blocked_s
        assert await three.catalog.leases(RUN) == before  # same owners, same generations
        await wait_healthy(client, [r1, r2, r3], timeout_s=3 * REPLICA_LEASE_S)


@pytest.mark.timeout(180)
async def test_a_stopped_replica_is_named_until_its_partitions_move(three: Replicas) -> None:
    """r3 is SIGSTOPped: r1 and r2 name r3's partitions (its heartbeat late, then its lease
    expired) while their own ``/readyz`` stays 200 as long as their own projectors are ok;
    within the lease and a refold r3's partitions are theirs and the run is healthy again."""
    r1, r2, r3 = three.members
    before = await three.catalog.leases(RUN)
    mine = {p for p, (owner, _) in before.items() if owner == "r3"}
    async with httpx.AsyncClient(timeout=30) as client:
        await wait_healthy(client, [r1, r2], timeout_s=30)
        r3.pause()
        stopped = time.monotonic()
        try:
            states: dict[str, set[str]] = {"r1": set(), "r2": set()}
            while not all(states.values()):
                for other in (r1, r2):
                    code, ready, run = await health(client, other)
                    if run["local"] is not None and run["local"]["status"] == "ok":
                        assert code == 200, ready
                    found = named(run, "r3", mine)
                    if found and found == named(ready, "r3", mine):
                        states[other.replica_id].update(found.values())
                assert time.monotonic() - stopped < 4 * REPLICA_LEASE_S, states
                await asyncio.sleep(0.05)
            assert set().union(*states.values()) <= {"unresponsive", "lease_expired"}, states
            await three.catalog.wait_owned(
                RUN, PARTITIONS, {"r1", "r2"}, timeout_s=4 * REPLICA_LEASE_S + 10
            )
            await wait_healthy(client, [r1, r2], timeout_s=30)
            recovered_s = time.monotonic() - stopped
            assert recovered_s < 4 * REPLICA_LEASE_S + 30, recovered_s
        finally:
            r3.resume()
