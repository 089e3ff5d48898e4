"""The service SIGKILLed in the middle of a fork, on both deployments: after the fork's name was
claimed and its records copied into its log, before its catalog commit. The fork is then not
there at all (no run, not listed); asked again it is created whole, and continues its
episodes from the source's cuts."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
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
from tests.e2e._harness import Deployment, Service, catalog_writes_held
from tests.e2e.conftest import RUN

pytestmark = pytest.mark.slow

FORK = "crash-fork"
#: Enough records that the copy outlasts the test's polling of the claim (embedded).
EPISODES = 1200


async def call(service: Service, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKENS['admin']}", **kw.pop("headers", {})}
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.request(method, f"{service.url}{path}", headers=headers, **kw)


async def append(service: Service, events: list[Any]) -> None:
    body = b"".join(orjson.dumps(event) + b"\n" for event in wire(*events))
    response = await call(
        service,
        "POST",
        f"/v1/runs/{RUN}/events",
        content=body,
        headers={
            "Authorization": f"Bearer {TOKENS['participant']}",
            "Content-Type": "application/x-ndjson",
        },
    )
    assert response.status_code == 200, response.text


async def source_run(service: Service, trainer: AsyncTrainerClient) -> int:
    """The source: EPISODES live episodes past ``seed``, a checkpoint of them; its id."""
    await trainer.register_participant(RUN, "env-0", "environment")
    names = [f"e{i:04d}" for i in range(EPISODES)]
    for start in range(0, len(names), 400):
        batch = names[start : start + 400]
        await append(
            service,
            [
                event
                for name in batch
                for event in (f.started(name), f.boundary(name, "seed", {"turn": name}))
            ],
        )
    result = await trainer.checkpoint(RUN)
    assert result.counts["continue"] == EPISODES
    return result.checkpoint_id


@contextlib.asynccontextmanager
async def fork_commit_held(deployment: Deployment) -> AsyncIterator[Any]:
    """Hold the fork's catalog commit: PostgreSQL, a lock on ``checkpoints`` (the claim writes
    only ``runs``); SQLite, its one write lock, taken once the claim is visible."""
    if deployment.catalog_url is not None:
        async with catalog_writes_held(deployment, "checkpoints", RUN) as hold:
            yield hold
        return
    catalog = deployment.data_dir / "catalog.sqlite3"
    held: list[sqlite3.Connection] = []

    class Hold:
        async def wait_until_blocked(self, service: Service, run: str, log_records: int) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if claim_state(catalog) == "claimed":
                    conn = sqlite3.connect(catalog, isolation_level=None, timeout=30)
                    conn.execute("BEGIN IMMEDIATE")
                    held.append(conn)
                    # Still only claimed under the lock: the commit is provably to come.
                    assert claim_state(catalog) == "claimed", "the fork committed first"
                    await until_copied(deployment.data_dir / "log" / f"{FORK}.sqlite3")
                    return
                await asyncio.sleep(0.002)
            raise AssertionError("the fork never claimed its name")

    try:
        yield Hold()
    finally:
        for conn in held:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            conn.close()


def claim_state(catalog: Path) -> str | None:
    conn = sqlite3.connect(f"file:{catalog}?mode=ro", uri=True, timeout=30)
    try:
        row = conn.execute("SELECT forked_at FROM runs WHERE run = ?", (FORK,)).fetchone()
    finally:
        conn.close()
    if row is None:
        return None
    return "claimed" if row[0] is None else "created"


async def until_copied(log: Path) -> None:
    """Until the fork's embedded log holds its markers (the copy is over)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(sqlite3.Error):
            conn = sqlite3.connect(f"file:{log}?mode=ro", uri=True, timeout=5)
            try:
                ends = conn.execute("SELECT sum(count) FROM segments").fetchone()
            finally:
                conn.close()
            if ends[0] is not None and ends[0] >= 2 * EPISODES + 4:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the fork's log never got its records and markers")


async def test_a_fork_killed_before_its_commit_is_absent_then_created_whole(
    deployment: Deployment, service: Service, trainer: AsyncTrainerClient
) -> None:
    checkpoint_id = await source_run(service, trainer)
    async with fork_commit_held(deployment) as hold:
        request = asyncio.create_task(trainer.fork_run(FORK, RUN, checkpoint_id))
        await hold.wait_until_blocked(service, FORK, 0)
        assert not request.done()
        service.kill()
        with contextlib.suppress(Exception):
            await request
    await service.start()

    # Nothing of the fork is seen: no run, not listed, nothing to follow.
    assert (await call(service, "GET", f"/v1/runs/{FORK}")).status_code == 404
    listed = (await call(service, "GET", "/v1/runs")).json()["runs"]
    assert [r["run"] for r in listed] == [RUN]
    assert (await call(service, "GET", f"/v1/runs/{FORK}/checkpoints/1")).status_code == 404
    # The claimed name is the fork's: another fork under it is refused.
    other = await call(
        service, "POST", "/v1/runs", json={"run": FORK, "fork": {"run": RUN, "episodes": ["e0001"]}}
    )
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "run_exists"
    # So is a plain run of that name: the name is being forked, not unknown.
    plain = await call(service, "POST", "/v1/runs", json={"run": FORK})
    assert plain.status_code == 409, plain.text
    assert plain.json()["error"]["details"]["being_forked"] is True

    # The same fork again: created whole, from scratch.
    created = await trainer.fork_run(FORK, RUN, checkpoint_id)
    assert created["forked_from"]["checkpoint_id"] == checkpoint_id
    manifest = (await call(service, "GET", f"/v1/runs/{FORK}/checkpoints/1/manifest")).json()
    episodes = manifest["episodes"]
    assert len(episodes) == EPISODES
    assert {e["action"] for e in episodes} == {"continue"}
    ends = (await call(service, "GET", f"/v1/runs/{FORK}/stats")).json()["events"]
    assert ends["log_records"] == 2 * EPISODES + 4  # one copy of each record, four markers

    # Its restore continues every episode as attempt 1 from the source's boundary.
    await trainer.take_over(FORK)
    restore = await trainer.restore(FORK)
    assert dict(restore.counts) == {"continue": EPISODES, "restart": 0, "excluded": 0}
    seen = 0
    async for projection in trainer.projections(FORK, restore.restore_id, kind="environment"):
        boundary = projection["boundaries"]["environment"]
        assert (boundary["stage"], boundary["state"]) == ("seed", {"turn": projection["episode"]})
        assert projection["capture_key"] == f"{projection['episode']}-a1"
        seen += 1
    assert seen == EPISODES
