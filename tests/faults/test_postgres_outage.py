"""The PostgreSQL catalog SIGKILLed under a running service, and restarted.

A throwaway cluster of this module (``tests/faults/_postgres.py``; never the machine's own) is the
catalog of a real ``rolloutlog serve``, with the embedded log and with Kafka. While the catalog
is down: the service stays up, appends that need no catalog are acknowledged, everything that
needs it answers 503 ``unavailable``, and a checkpoint whose commit meets the outage is aborted,
not half-written. Once PostgreSQL is back on the same port and data dir, the same service
process commits checkpoints again, records the episode that finished during the outage as
``finished``, and its fold holds every acknowledged event. A service started while the catalog
is down exits with one line on stderr. A catalog that stalls (SIGSTOP: connections open, no
answers) is bounded by the catalog URL's timeouts: what needs it answers 503 within a few of them,
``/readyz`` within its probe bound, and all recovers when the server resumes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from rolloutlog.api._app import READY_PROBE_S
from tests import factories as f
from tests._services import ROOT, free_port
from tests.api.conftest import TOKENS, wire
from tests.e2e._harness import Deployment, Service, kafka_log_url
from tests.faults._postgres import PostgresCluster, postgres_cluster

pytestmark = pytest.mark.postgres

RUN = "outage"
COLD = "cold"  # created, never appended to: its fencing cache is empty when the catalog dies
EPISODES = ("e0", "e1", "e2", "e3")
RECOVERY_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    with postgres_cluster() as running:
        yield running


async def fresh_database(cluster: PostgresCluster) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(cluster.dsn)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return cluster.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
async def deployment(
    request: pytest.FixtureRequest, cluster: PostgresCluster, tmp_path: Path
) -> Deployment:
    catalog_url = await fresh_database(cluster)
    if request.param == "embedded":
        return Deployment("embedded+pg", tmp_path / "data", None, catalog_url)
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    return Deployment("kafka+pg", tmp_path / "data", kafka_log_url(bootstrap), catalog_url)


class Client:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.seq = 0

    async def call(self, method: str, path: str, role: str = "admin", **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKENS[role]}"}
        return await self.http.request(method, path, headers=headers, **kw)

    async def append(self, run: str, *events: Any) -> httpx.Response:
        return await self.call("POST", f"/v1/runs/{run}/events", "participant", json=wire(*events))

    async def checkpoint(self, epoch: int, **body: Any) -> httpx.Response:
        return await self.call(
            "POST", f"/v1/runs/{RUN}/checkpoints", json={"controller_epoch": epoch, **body}
        )

    async def episodes(self) -> dict[str, dict[str, Any]]:
        response = await self.call("GET", f"/v1/runs/{RUN}/episodes", "analyst")
        assert response.status_code == 200, response.text
        return {e["episode"]: e for e in response.json()["episodes"]}


def unavailable(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["code"] == "unavailable"


async def until(what: str, check: Any, timeout_s: float = RECOVERY_S) -> Any:
    """Poll ``check()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.2)


@pytest.mark.slow  # ~9 s on a quiet machine
async def test_catalog_killed_and_restarted_under_a_running_service(
    cluster: PostgresCluster, deployment: Deployment, tmp_path: Path
) -> None:
    service = Service(deployment, tmp_path)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
            await outage_scenario(Client(http), cluster, service)
    finally:
        if cluster.proc is None or cluster.proc.poll() is not None:
            cluster.start()  # the next test of the module needs it
        service.stop()


async def _seed(api: Client, *runs: str) -> tuple[int, dict[str, Any]]:
    """Create the runs with an environment registered in each, take ``RUN``'s controller and
    start ``EPISODES`` there, each at a first boundary; the epoch and each episode's state."""
    for run in runs:
        assert (await api.call("POST", "/v1/runs", json={"run": run, "partitions": 2})).is_success
        registered = await api.call(
            "POST", f"/v1/runs/{run}/participants", json={"id": "env-0", "kind": "environment"}
        )
        assert registered.status_code == 201, registered.text
    epoch = (await api.call("POST", f"/v1/runs/{RUN}/controller")).json()["controller_epoch"]
    last_state: dict[str, Any] = {}
    events = []
    for episode in EPISODES:
        last_state[episode] = {"episode": episode, "n": 0}
        events += [f.started(episode), f.boundary(episode, "seed", last_state[episode], step=0)]
    assert (await api.append(RUN, *events)).status_code == 200
    return epoch, last_state


async def outage_scenario(api: Client, cluster: PostgresCluster, service: Service) -> None:
    epoch, last_state = await _seed(api, RUN, COLD)
    first = await api.checkpoint(epoch)
    assert first.status_code == 201, first.text
    # The catalog knows every episode as running before it goes away.
    await until(
        "the catalog records the episodes",
        lambda: _recorded(api, {e: "running" for e in EPISODES}),
    )
    # e0 opens a wait step: the next checkpoint stays pending until e0's boundary.
    assert (await api.append(RUN, f.step_started("e0", "close_agent", "wait"))).is_success
    pending = await api.checkpoint(epoch, wait=False, deadline_s=120)
    assert pending.status_code == 202, pending.text
    pending_id = pending.json()["checkpoint_id"]

    cluster.kill()

    # Appends that need no catalog are acknowledged. e0's boundary resolves the pending
    # checkpoint, whose commit meets the outage; e1 finishes.
    last_state["e0"] = {"episode": "e0", "n": 1}
    acknowledged = [f.boundary("e0", "close_agent", last_state["e0"], step=1)]
    for episode in ("e2", "e3"):
        last_state[episode] = {"episode": episode, "n": 1}
        acknowledged.append(f.boundary(episode, "invoke_agent", last_state[episode], step=1))
    acknowledged.append(f.finished("e1"))
    for event in acknowledged:
        response = await api.append(RUN, event)
        assert response.status_code == 200, response.text
    await until(
        f"checkpoint {pending_id}'s commit meets the outage",
        lambda: _logged(service, f"checkpoint {pending_id} of run {RUN} could not be aborted"),
        timeout_s=30,
    )

    # What needs the catalog answers 503 unavailable (retriable), and writes nothing.
    cold = await api.append(COLD, f.started("c0"))
    assert unavailable(cold), cold.text
    stranger = f.started("e9", who=f.participant(pid="env-9"))  # not in the epoch cache
    assert unavailable(await api.append(RUN, stranger)), "unknown participant"
    assert unavailable(await api.checkpoint(epoch)), "checkpoint"
    restore = await api.call(
        "POST",
        f"/v1/runs/{RUN}/restores",
        json={"controller_epoch": epoch, "checkpoint_id": "latest"},
    )
    assert unavailable(restore), restore.text
    ready = await api.call("GET", "/readyz")
    assert ready.status_code == 503, ready.text
    body = ready.json()
    assert body.get("catalog", body.get("checks", {}).get("catalog")) != "ok", body
    assert (await api.call("GET", "/healthz")).status_code == 200

    cluster.start()  # same port, same data dir: crash recovery

    # Without restarting the service: the failed commit's checkpoint is aborted (until then the
    # next checkpoint is refused as in progress), and the next one commits.
    async def next_checkpoint() -> dict[str, Any] | None:
        response = await api.checkpoint(epoch)
        if response.status_code == 201:
            committed: dict[str, Any] = response.json()
            return committed
        code = response.json()["error"]["code"]
        assert code in ("unavailable", "checkpoint_in_progress"), response.text
        return None

    second = await until("a checkpoint commits again", next_checkpoint)
    assert second["checkpoint_id"] == pending_id + 1  # the refused one took no id
    assert second["counts"] == {"continue": 3, "restart": 0, "finished": 1}, second
    aborted = await api.call("GET", f"/v1/runs/{RUN}/checkpoints/{pending_id}")
    assert aborted.json()["status"] == "aborted", aborted.text
    manifest = await api.call("GET", f"/v1/runs/{RUN}/checkpoints/{pending_id}/manifest")
    assert manifest.status_code == 404, manifest.text
    ready = await api.call("GET", "/readyz")
    assert ready.status_code == 200, ready.text

    # Every acknowledged event is in the log and in the fold: the checkpoint's projections
    # (replayed from the log) hold each live episode's last boundary, the manifest e1's finish.
    for episode in ("e0", "e2", "e3"):
        response = await api.call(
            "GET",
            f"/v1/runs/{RUN}/episodes/{episode}/projection",
            params={"checkpoint": second["checkpoint_id"]},
        )
        assert response.status_code == 200, response.text
        assert response.json()["boundaries"]["environment"]["state"] == last_state[episode]
    manifest = await api.call(
        "GET", f"/v1/runs/{RUN}/checkpoints/{second['checkpoint_id']}/manifest"
    )
    actions = {e["episode"]: e["action"] for e in manifest.json()["episodes"]}
    assert actions == {"e0": "continue", "e1": "finished", "e2": "continue", "e3": "continue"}

    # The finish that met the outage reaches the analysts' view.
    await until(
        "e1 shows finished",
        lambda: _recorded(
            api, {"e0": "running", "e1": "finished", "e2": "running", "e3": "running"}
        ),
    )
    # The cold run's fencing cache loads now; a restore commits.
    assert (await api.append(COLD, f.started("c0"))).status_code == 200
    restore = await api.call(
        "POST",
        f"/v1/runs/{RUN}/restores",
        json={"controller_epoch": epoch, "checkpoint_id": "latest"},
    )
    assert restore.status_code == 201, restore.text
    assert restore.json()["restore_id"] == 1  # the refused one reserved none
    assert service.proc is not None and service.proc.poll() is None  # never restarted
    assert service.starts == 1


async def _recorded(api: Client, expected: dict[str, str]) -> bool:
    """The catalog (not only the projector) has each episode with the expected status."""
    found = await api.episodes()
    return all(
        episode in found
        and found[episode]["updated_at"] is not None
        and found[episode]["status"] == status
        for episode, status in expected.items()
    )


async def _logged(service: Service, text: str) -> bool:
    return text in service.output.read_text(errors="replace")


def test_start_with_the_catalog_down_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql+asyncpg://postgres:secret@127.0.0.1:{port}/postgres"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rolloutlog.api.cli", "serve"),
            *("--data-dir", str(tmp_path), "--port", str(free_port()), "--catalog", url),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("rolloutlog serve: cannot start: "), lines[0]
    assert "catalog unreachable" in lines[0] and "Connection refused" in lines[0], lines[0]
    assert f"127.0.0.1:{port}" in lines[0] and "secret" not in lines[0], lines[0]
    assert done.stdout == ""


# The stalled catalog's bounds (URL parameters of the PostgreSQL backend): short, so that the test
# is quick. What needs the catalog must answer within a few of them; /readyz within its own probe.
STALL_BOUNDS = "command_timeout=1.5&pool_timeout=1.5&connect_timeout=1.5"
STALL_ANSWER_S = 12.0
STALL_S = 8.0
#: /readyz probes the log, then the catalog, each for at most READY_PROBE_S.
READY_WITHIN_S = 2 * READY_PROBE_S + 1.0


@pytest.mark.slow  # ~15 s on a quiet machine
async def test_catalog_stalled_under_a_running_service(
    cluster: PostgresCluster, deployment: Deployment, tmp_path: Path
) -> None:
    """SIGSTOP, not SIGKILL: every connection stays open and nothing answers. Without bounds on
    the driver's waits this hung checkpoints, restores and ``/readyz`` for as long as the stall."""
    bounded = dataclasses.replace(
        deployment, catalog_url=f"{deployment.catalog_url}?{STALL_BOUNDS}"
    )
    service = Service(bounded, tmp_path)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
            await stall_scenario(Client(http), cluster)
    finally:
        if cluster.proc is not None and cluster.proc.poll() is None:
            cluster.thaw()  # the next test of the module needs it
        service.stop()


async def _timed(request: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await request
    return response, time.monotonic() - started


async def stall_scenario(api: Client, cluster: PostgresCluster) -> None:
    epoch, last_state = await _seed(api, RUN)
    assert (await api.checkpoint(epoch)).status_code == 201

    cluster.freeze()
    stalled_at = time.monotonic()
    # What needs the catalog, asked while appends go on beside it.
    catalog_calls = asyncio.gather(
        _timed(api.checkpoint(epoch)),
        _timed(
            api.call(
                "POST",
                f"/v1/runs/{RUN}/restores",
                json={"controller_epoch": epoch, "checkpoint_id": "latest"},
            )
        ),
        _timed(api.call("GET", "/readyz")),
    )
    step = 0
    while time.monotonic() - stalled_at < STALL_S:
        step += 1
        for episode in ("e0", "e2", "e3"):
            last_state[episode] = {"episode": episode, "n": step}
            event = f.boundary(episode, "invoke_agent", last_state[episode], step=step)
            appended, took = await _timed(api.append(RUN, event))
            assert appended.status_code == 200, appended.text
            assert took < 2.0, f"an append that needs no catalog took {took:.1f} s"
        await asyncio.sleep(0.2)
    assert (await api.append(RUN, f.finished("e1"))).status_code == 200
    (checkpoint, checkpoint_s), (restore, restore_s), (ready, ready_s) = await catalog_calls
    assert unavailable(checkpoint) and checkpoint_s < STALL_ANSWER_S, (
        checkpoint_s,
        checkpoint.text,
    )
    assert unavailable(restore) and restore_s < STALL_ANSWER_S, (restore_s, restore.text)
    assert ready.status_code == 503 and ready_s < READY_WITHIN_S, (ready_s, ready.text)
    assert ready.json()["catalog"] != "ok", ready.text
    # Once more, now that nothing of the stalled calls holds a pooled connection.
    ready, ready_s = await _timed(api.call("GET", "/readyz"))
    assert ready.status_code == 503 and ready_s < READY_WITHIN_S, (ready_s, ready.text)
    assert (await api.call("GET", "/healthz")).status_code == 200

    cluster.thaw()

    async def next_checkpoint() -> dict[str, Any] | None:
        response = await api.checkpoint(epoch)
        if response.status_code == 201:
            committed: dict[str, Any] = response.json()
            return committed
        code = response.json()["error"]["code"]
        assert code in ("unavailable", "checkpoint_in_progress"), response.text
        return None

    committed = await until("a checkpoint commits again", next_checkpoint)
    assert committed["counts"] == {"continue": 3, "restart": 0, "finished": 1}, committed

    async def ready_again() -> bool:
        return (await api.call("GET", "/readyz")).status_code == 200

    await until("/readyz is 200 again", ready_again)
    # Every acknowledged event is in the log and in the fold.
    for episode in ("e0", "e2", "e3"):
        response = await api.call(
            "GET",
            f"/v1/runs/{RUN}/episodes/{episode}/projection",
            params={"checkpoint": committed["checkpoint_id"]},
        )
        assert response.status_code == 200, response.text
        assert response.json()["boundaries"]["environment"]["state"] == last_state[episode]
    restore = await api.call(
        "POST",
        f"/v1/runs/{RUN}/restores",
        json={"controller_epoch": epoch, "checkpoint_id": "latest"},
    )
    assert restore.status_code == 201, restore.text
