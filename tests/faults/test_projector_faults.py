"""A run's projector under real faults, with a real ``rolloutlog serve``: it reports ``degraded``
while it cannot read (``/readyz`` 503), retries with backoff and recovers by itself (``ok``, 200)
when the fault ends; other runs go on meanwhile; a checkpoint of the degraded run fails with 503
``unavailable`` at its deadline instead of hanging, and commits after the recovery. A run whose
log lost records (deleted, recreated empty, a broker restarted empty) is ``stopped`` at start-up,
its appends and checkpoints refused with ``run_lost``, and it never blocks the service's start."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutlog.errors import RunLost
from rolloutlog.log import open_log
from tests import factories as f
from tests.api.conftest import bearer, open_api, settings_for, wire
from tests.e2e._harness import Deployment
from tests.faults._supervise import UnreadyService, eventually, own_tansu

PARTITIONS = 4
#: A boundary state this large goes to the embedded log's blob files (64 KiB and up).
BIG_STATE = {"blob": "x" * 100_000}


class Client:
    """The service's REST API as the tests use it: one run at a time, with its controller."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.epochs: dict[str, int] = {}

    async def call(self, method: str, url: str, role: str, **kw: Any) -> httpx.Response:
        return await self.client.request(method, url, headers=bearer(role), **kw)

    async def create(self, run: str) -> None:
        response = await self.call(
            "POST", "/v1/runs", "trainer", json={"run": run, "partitions": PARTITIONS}
        )
        assert response.status_code == 201, response.text
        response = await self.call(
            "POST",
            f"/v1/runs/{run}/participants",
            "participant",
            json={"id": "env-0", "kind": "environment"},
        )
        assert response.status_code == 201, response.text
        await self.take_over(run)

    async def take_over(self, run: str) -> None:
        response = await self.call("POST", f"/v1/runs/{run}/controller", "trainer")
        self.epochs[run] = response.json()["controller_epoch"]

    async def append(self, run: str, *events: Any) -> httpx.Response:
        return await self.call("POST", f"/v1/runs/{run}/events", "participant", json=wire(*events))

    async def checkpoint(self, run: str, **body: Any) -> httpx.Response:
        body.setdefault("controller_epoch", self.epochs[run])
        return await self.call("POST", f"/v1/runs/{run}/checkpoints", "trainer", json=body)

    async def health(self, run: str) -> dict[str, Any]:
        response = await self.call("GET", f"/v1/runs/{run}", "analyst")
        assert response.status_code == 200, response.text
        health: dict[str, Any] = response.json()["health"]
        return health

    async def ready(self) -> tuple[int, dict[str, Any]]:
        response = await self.client.get("/readyz")
        body: dict[str, Any] = response.json()
        return response.status_code, body

    async def wait_health(self, run: str, status: str, timeout_s: float = 30.0) -> None:
        async def reached() -> bool:
            return (await self.health(run))["status"] == status

        await eventually(reached, timeout_s, f"run {run} {status}")


async def _committed(client: Client, run: str) -> dict[str, Any]:
    response = await client.checkpoint(run)
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


async def test_embedded_projector_degrades_and_recovers_others_unaffected(tmp_path: Path) -> None:
    service = UnreadyService(Deployment("embedded", tmp_path / "data"), tmp_path)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            client = Client(http)
            for run in ("sick", "well"):
                await client.create(run)
                response = await client.append(run, f.started("e1"), f.boundary("e1", "seed"))
                assert response.status_code == 200, response.text
            assert (await client.ready())[0] == 200
            # The writer opens the run's blob file with its first large record, and keeps it.
            response = await client.append("sick", f.boundary("e1", "big-0", BIG_STATE))
            assert response.status_code == 200, response.text
            # The fault: the sick run's blob files become unreachable (as an unmounted volume
            # would); the writer keeps its open file, so appends are still acknowledged.
            blobs = tmp_path / "data" / "log" / "sick.blobs"
            away = blobs.with_name("sick.blobs.away")
            blobs.rename(away)
            try:
                response = await client.append("sick", f.boundary("e1", "big", BIG_STATE))
                assert response.status_code == 200, response.text
                await client.wait_health("sick", "degraded")
                health = await client.health("sick")
                assert health["error"] and health["since"] > 0
                status, ready = await client.ready()
                assert status == 503 and ready["status"] == "unready"
                assert ready["runs"]["sick"]["status"] == "degraded"
                assert ready["runs"]["well"]["status"] == "ok"
                # The other run goes on.
                response = await client.append("well", f.boundary("e1", "next"))
                assert response.status_code == 200
                assert (await _committed(client, "well"))["status"] == "committed"
                # A checkpoint of the degraded run fails at its deadline, and aborts.
                response = await client.checkpoint("sick", deadline_s=1.0)
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "unavailable"
                listed = await client.call("GET", "/v1/runs/sick/checkpoints", "analyst")
                assert [c["status"] for c in listed.json()["checkpoints"]] == ["aborted"]
            finally:
                away.rename(blobs)
            # Recovers by itself once the fault ends.
            await client.wait_health("sick", "ok")

            async def ready() -> bool:
                return (await client.ready())[0] == 200

            await eventually(ready, 30, "readiness after the fault")
            result = await _committed(client, "sick")
            projection = await client.call(
                "GET",
                f"/v1/runs/sick/episodes/e1/projection?checkpoint={result['checkpoint_id']}",
                "participant",
            )
            assert projection.status_code == 200, projection.text
            boundary = projection.json()["boundaries"]["environment"]
            assert boundary["stage"] == "big" and boundary["state"] == BIG_STATE
    finally:
        service.stop()


async def test_embedded_start_with_lost_runs_serves_the_others(tmp_path: Path) -> None:
    data = tmp_path / "data"
    service = UnreadyService(Deployment("embedded", data), tmp_path)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            client = Client(http)
            for run in ("deleted", "recreated", "fine"):
                await client.create(run)
                response = await client.append(run, f.started("e1"), f.boundary("e1", "seed"))
                assert response.status_code == 200
                await _committed(client, run)
        service.stop()
        # The faults, while it is down: one run's log file is gone, another's is recreated empty.
        log_dir = data / "log"
        for path in log_dir.glob("deleted.*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in log_dir.glob("recreated.*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log = open_log(data)
        async with log:
            await log.ensure_run("recreated", PARTITIONS)
        await service.start()  # it serves (waits for /healthz): the lost runs do not stop it
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            client = Client(http)
            for run in ("deleted", "recreated", "fine"):
                await client.take_over(run)
            status, ready = await client.ready()
            assert status == 503
            assert ready["runs"]["fine"]["status"] == "ok"
            deleted = await client.health("deleted")
            assert deleted["status"] == "stopped" and "no log topic" in deleted["error"]
            recreated = await client.health("recreated")
            assert recreated["status"] == "stopped"
            assert "checkpoint 1" in recreated["error"], recreated
            for run in ("deleted", "recreated"):
                response = await client.append(run, f.boundary("e1", "after", attempt=0))
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "run_lost"
                response = await client.checkpoint(run)
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "run_lost"
            response = await client.append("fine", f.boundary("e1", "after"))
            assert response.status_code == 200
            assert (await _committed(client, "fine"))["status"] == "committed"
        # The recreated log was never written to by the service (stopped: it holds the lock).
        service.stop()
        log = open_log(data)
        async with log:
            assert await log.end_offsets("recreated") == [0] * PARTITIONS
            assert not (log_dir / "deleted.sqlite3").exists()
    finally:
        service.stop()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
async def test_kafka_broker_stall_degrades_then_recovers(
    tmp_path: Path, postgres_schema: str
) -> None:
    with own_tansu() as tansu:
        log_url = f"kafka://{tansu.bootstrap}?topic_prefix=st.&request_timeout_ms=3000"
        service = UnreadyService(
            Deployment("kafka", tmp_path / "data", log_url, postgres_schema), tmp_path
        )
        await service.start()
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
                client = Client(http)
                await client.create("stall")
                response = await client.append("stall", f.started("e1"), f.boundary("e1"))
                assert response.status_code == 200, response.text
                await _committed(client, "stall")
                tansu.pause()  # SIGSTOP: the broker stalls
                try:
                    await client.wait_health("stall", "degraded", timeout_s=20)
                    assert (await client.ready())[0] == 503
                finally:
                    await asyncio.sleep(2)
                    tansu.resume()  # SIGCONT
                await client.wait_health("stall", "ok", timeout_s=30)

                async def ready() -> bool:
                    return (await client.ready())[0] == 200

                await eventually(ready, 30, "readiness after the stall")
                response = await client.append("stall", f.boundary("e1", "after-stall"))
                assert response.status_code == 200, response.text
                result = await _committed(client, "stall")
                assert result["counts"]["continue"] == 1
        finally:
            service.stop()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
async def test_kafka_broker_restarted_empty_stops_the_run(
    tmp_path: Path, postgres_schema: str
) -> None:
    with own_tansu() as tansu:
        port = tansu.port
        log_url = f"kafka://{tansu.bootstrap}?topic_prefix=re."
        service = UnreadyService(
            Deployment("kafka", tmp_path / "data", log_url, postgres_schema), tmp_path
        )
        await service.start()
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
                client = Client(http)
                await client.create("lost")
                response = await client.append("lost", f.started("e1"), f.boundary("e1"))
                assert response.status_code == 200, response.text
                await _committed(client, "lost")
            service.kill()
        finally:
            service.stop()
    with own_tansu(port):  # the broker restarted empty (memory storage)
        await service.start()
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
                client = Client(http)
                await client.take_over("lost")
                health = await client.health("lost")
                assert health["status"] == "stopped", health
                status, ready = await client.ready()
                assert status == 503 and ready["runs"]["lost"]["status"] == "stopped"
                response = await client.append("lost", f.boundary("e1", "again"))
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "run_lost"
                # Another run on the new broker serves.
                await client.create("fresh")
                response = await client.append("fresh", f.started("e1"), f.boundary("e1"))
                assert response.status_code == 200, response.text
                assert (await _committed(client, "fresh"))["status"] == "committed"
        finally:
            service.stop()


async def test_a_log_that_reports_the_run_lost_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a backend raises when it finds the topic gone while the service runs (Kafka's own
    detection): the run is stopped, appends and checkpoints refused, other runs go on."""
    async with open_api(settings_for(tmp_path / "data")) as api:
        await api.seed(["a"])
        log = api.service.log
        follow_run = log.follow_run

        async def lost(run: str, starts: Any, **kw: Any) -> Any:
            if run == "run":
                raise RunLost("the topic of run 'run' is gone", run=run)
            async for item in follow_run(run, starts, **kw):
                yield item

        monkeypatch.setattr(log, "follow_run", lost)
        await api.service.coordinator.projectors["run"].stop()
        del api.service.coordinator.projectors["run"]
        await api.service.coordinator.projector("run")
        run = (await api.call("GET", "/v1/runs/run", "analyst", 200)).json()
        assert run["health"]["status"] == "stopped", run
        assert "gone" in run["health"]["error"]
        refused = await api.append(f.boundary("a", "later"), expect=503)
        assert refused.json()["error"]["code"] == "run_lost"
        assert (await api.checkpoint(expect=503))["error"]["code"] == "run_lost"
        ready = await api.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["runs"]["run"]["status"] == "stopped"
        await api.create_run("other")
        api.run = "other"
        await api.register()
        await api.take_over()
        await api.append(f.started("b"), f.boundary("b"))
        assert (await api.checkpoint())["status"] == "committed"
