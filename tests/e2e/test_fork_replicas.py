"""One fork asked of two replicas (two ``rolloutlog serve`` processes on one Kafka (Tansu) log
and one PostgreSQL catalog): the fork's claim in the catalog names the replica that copies, so
the other answers ``503 unavailable`` (``fork_in_progress``, ``Retry-After``) while that one
lives, and the fork's log gets one copy of each record. A holder SIGKILLed after its copy,
before its commit, is taken over by the other replica once its lease lapsed: the partial copy
is dropped and the fork is created whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.trainer import AsyncTrainerClient
from tests import factories as f
from tests.api.conftest import TOKENS, wire
from tests.e2e._harness import REPLICA_LEASE_S, Deployment, Replica, Replicas, catalog_writes_held
from tests.e2e.conftest import KAFKA_ONLY

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, KAFKA_ONLY]

SOURCE, FORK = "fence-src", "fence-fork"
PARTITIONS = 4
#: Enough records that the copy outlasts the other replica's request.
EPISODES = 1200
#: What b's log holds when the fork is whole and copied once: each episode's two records, and
#: one marker per partition.
WHOLE = 2 * EPISODES + PARTITIONS
#: Beyond the holder's lease, what the takeover may take (the asker's retries, the copy afresh
#: on a shared 2-core machine).
TAKEOVER_SLACK_S = 30.0


@pytest.fixture
async def two(deployment: Deployment, tmp_path: Path) -> AsyncIterator[Replicas]:
    replicas = Replicas(deployment, tmp_path, 2)
    try:
        await replicas.start()
        yield replicas
    finally:
        replicas.stop()


async def call(
    replica: Replica, method: str, path: str, role: str = "admin", **kw: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKENS[role]}", **kw.pop("headers", {})}
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.request(method, f"{replica.url}{path}", headers=headers, **kw)


async def source_run(replica: Replica) -> int:
    """The source: EPISODES live episodes past ``seed``, a checkpoint of them; its id."""
    trainer = AsyncTrainerClient(replica.url, token=TOKENS["admin"], timeout_s=120)
    try:
        await trainer.create_run(SOURCE, partitions=PARTITIONS)
        await trainer.register_participant(SOURCE, "env-0", "environment")
        names = [f"e{i:04d}" for i in range(EPISODES)]
        for start in range(0, len(names), 400):
            events = [
                event
                for name in names[start : start + 400]
                for event in (f.started(name), f.boundary(name, "seed", {"turn": name}))
            ]
            response = await call(
                replica,
                "POST",
                f"/v1/runs/{SOURCE}/events",
                "participant",
                content=b"".join(orjson.dumps(e) + b"\n" for e in wire(*events)),
                headers={"Content-Type": "application/x-ndjson"},
            )
            assert response.status_code == 200, response.text
        await trainer.take_over(SOURCE)
        result = await trainer.checkpoint(SOURCE)
    finally:
        await trainer.stop()
    assert result.counts["continue"] == EPISODES
    return result.checkpoint_id


def fork_body(checkpoint_id: int) -> dict[str, Any]:
    return {"run": FORK, "fork": {"run": SOURCE, "checkpoint_id": checkpoint_id}}


async def fork_until_answered(
    replica: Replica, checkpoint_id: int, refused: list[str]
) -> httpx.Response:
    """Ask ``replica`` for the fork, again after each ``fork_in_progress`` (as ``Retry-After``
    says); each refusal is noted in ``refused`` (the replica that refused)."""
    while True:
        response = await call(replica, "POST", "/v1/runs", "trainer", json=fork_body(checkpoint_id))
        if response.status_code != 503:
            return response
        error = response.json()["error"]
        assert error["code"] == "unavailable", response.text
        assert error["details"]["fork_in_progress"] is True, response.text
        assert error["details"]["holder"] != replica.replica_id
        refused.append(replica.replica_id)
        await asyncio.sleep(int(response.headers["Retry-After"]))


async def assert_whole(replicas: Replicas) -> None:
    """The fork is whole, in one copy, the same from either replica that is up."""
    for replica in replicas:
        if replica.proc is None or replica.proc.poll() is not None:
            continue
        manifest = (await call(replica, "GET", f"/v1/runs/{FORK}/checkpoints/1/manifest")).json()
        assert len(manifest["episodes"]) == EPISODES
        assert {e["action"] for e in manifest["episodes"]} == {"continue"}
        stats = (await call(replica, "GET", f"/v1/runs/{FORK}/stats")).json()
        assert stats["events"]["log_records"] == WHOLE, "the fork's log holds more than one copy"
    rows = await replicas.catalog.fetch(
        "SELECT forked_at, fork_claimed_by FROM runs WHERE run = $1", FORK
    )
    assert rows[0]["forked_at"] is not None
    assert rows[0]["fork_claimed_by"] is None  # created: nobody holds a claim any more


async def test_two_replicas_asked_for_one_fork_at_once_copy_it_once(two: Replicas) -> None:
    r1, r2 = two.members
    checkpoint_id = await source_run(r1)
    refused: list[str] = []
    answers = await asyncio.gather(
        fork_until_answered(r1, checkpoint_id, refused),
        fork_until_answered(r2, checkpoint_id, refused),
    )
    assert sorted(a.status_code for a in answers) == [200, 201], [a.text for a in answers]
    # The later one was refused while the other copied, then answered the fork it created.
    assert len(set(refused)) == 1, f"no replica answered fork_in_progress: {refused}"
    for answer in answers:
        assert answer.json()["forked_from"]["checkpoint_id"] == checkpoint_id
    await assert_whole(two)


async def test_a_fork_holder_killed_before_its_commit_is_taken_over_within_its_lease(
    deployment: Deployment, two: Replicas
) -> None:
    r1, r2 = two.members
    checkpoint_id = await source_run(r1)
    async with catalog_writes_held(deployment, "checkpoints", SOURCE) as hold:
        request = asyncio.create_task(
            call(r1, "POST", "/v1/runs", "trainer", json=fork_body(checkpoint_id))
        )
        await hold.wait_until_blocked(r1, FORK, 0)  # r1 copied, its commit waits
        claim = await two.catalog.fetch(
            "SELECT forked_at, fork_claimed_by FROM runs WHERE run = $1", FORK
        )
        assert [(c["forked_at"], c["fork_claimed_by"]) for c in claim] == [(None, "r1")]
        assert await two.catalog.waiting_on_lock(r1.pid)
        r1.kill()
        killed_at = time.monotonic()
    with pytest.raises(httpx.HTTPError):  # r1 died unanswered
        await request
    refused: list[str] = []
    answer = await fork_until_answered(r2, checkpoint_id, refused)
    took_s = time.monotonic() - killed_at
    print(f"r2 created the fork {took_s:.1f} s after r1 was SIGKILLed (lease {REPLICA_LEASE_S} s)")
    assert answer.status_code == 201, answer.text
    assert refused, "r2 took the claim over while r1's lease still ran"
    assert took_s < REPLICA_LEASE_S + TAKEOVER_SLACK_S
    await assert_whole(two)
    view = (await call(r2, "GET", f"/v1/runs/{FORK}")).json()
    assert view["forked_from"]["checkpoint_id"] == checkpoint_id
