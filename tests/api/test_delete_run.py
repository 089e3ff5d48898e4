"""``DELETE /v1/runs/{run}`` on both deployments: the run's log, catalog rows
and the service's caches are released, and a fresh run reuses the name."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.errors import UnknownRun
from rolloutlog.trainer import AsyncTrainerClient
from tests import factories as f
from tests.api.conftest import TOKENS, Api, open_api, settings_for


async def test_deleted_run_is_released_and_its_name_reusable(api: Api) -> None:
    await deleted_and_reused(api)


@pytest.mark.kafka
@pytest.mark.postgres
async def test_deleted_run_is_released_on_kafka_and_postgres(
    kafka_bootstrap: str, postgres_schema: str, tmp_path: Path
) -> None:
    settings = settings_for(
        tmp_path / "data",
        log_url=f"kafka://{kafka_bootstrap}?topic_prefix=d{uuid.uuid4().hex[:10]}.",
        catalog_url=postgres_schema,
    )
    async with open_api(settings) as api:
        await deleted_and_reused(api)
        # The topic is gone from the broker, not only from the service's view.
        topic = api.service.log.topic_name(api.run)  # type: ignore[attr-defined]
        await api.call("DELETE", f"/v1/runs/{api.run}", "trainer", 200)
        assert await api.service.log._describe(topic) is None  # type: ignore[attr-defined]


async def deleted_and_reused(api: Api) -> None:
    await api.seed(["a", "b"])
    assert await api.register() == 2  # a second registration: epoch 2 in the fencing cache
    await api.checkpoint(wait=True)

    reply = await api.call("DELETE", f"/v1/runs/{api.run}", "trainer", 200)
    assert reply.json() == {"run": api.run, "deleted": True}
    assert api.run not in api.service.coordinator.projectors
    assert api.run not in api.service.fencing
    checkpointer = api.service.coordinator._checkpointer
    assert api.run not in checkpointer._trimmed and api.run not in checkpointer._staged
    await api.call("GET", f"/v1/runs/{api.run}", "analyst", 404)
    missing = await api.call("DELETE", f"/v1/runs/{api.run}", "trainer", 404)
    assert missing.json()["error"]["code"] == "unknown_run"
    listed = await api.call("GET", "/v1/runs", "analyst", 200)
    assert api.run not in [run["run"] for run in listed.json()["runs"]]

    # A fresh run under the name: other partitions, epochs from 1, no old episodes or checkpoints.
    await api.create_run(partitions=2)
    assert await api.register() == 1
    await api.append(f.started("c"))  # epoch 1 is current again, not fenced by the old epoch 2
    assert await api.log_ends() in ([1, 0], [0, 1])
    await api.take_over()
    checkpoint = await api.checkpoint(wait=True)
    assert checkpoint["checkpoint_id"] == 1
    assert checkpoint["counts"]["continue"] == 1
    episodes = await api.call("GET", f"/v1/runs/{api.run}/episodes", "analyst", 200)
    assert [e["episode"] for e in episodes.json()["episodes"]] == ["c"]


class HeldCatalog:
    """The checkpointer's catalog, whose reads for the log trim (the committed checkpoints,
    then each one's offsets) wait for ``release`` once done."""

    def __init__(self, catalog: Any) -> None:
        self._catalog = catalog
        self._trimming = False
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)

    async def list_checkpoints(self, run: str, **kw: Any) -> Any:
        self._trimming = kw.get("status") == "committed"
        return await self._catalog.list_checkpoints(run, **kw)

    async def get_checkpoint(self, run: str, checkpoint_id: int) -> Any:
        found = await self._catalog.get_checkpoint(run, checkpoint_id)
        if self._trimming:
            self.reading.set()
            await self.release.wait()
        return found


async def test_a_trim_under_way_does_not_outlive_the_deleted_run(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log trim a commit spawns read the catalog when the run is deleted: the deletion
    ends it, so it neither brings back the run's trim floor nor trims the run created again
    under the name by the deleted run's checkpoints."""
    checkpointer = api.service.coordinator._checkpointer
    held = HeldCatalog(checkpointer.catalog)
    monkeypatch.setattr(checkpointer, "catalog", held)
    await api.seed(["a"])
    await api.checkpoint(wait=True)
    await asyncio.wait_for(held.reading.wait(), 10)

    await api.call("DELETE", f"/v1/runs/{api.run}", "trainer", 200)
    held.release.set()
    for _ in range(10):  # a trim left behind would finish now
        await asyncio.sleep(0)
    assert api.run not in checkpointer._trimmed
    assert not checkpointer._trims.get(api.run)


async def test_deleting_an_unknown_run_is_404(api: Api) -> None:
    reply = await api.call("DELETE", "/v1/runs/never", "trainer", 404)
    assert reply.json()["error"]["code"] == "unknown_run"


async def test_trainer_client_deletes_a_run(api: Api) -> None:
    await api.create_run()
    async with AsyncTrainerClient(token=TOKENS["trainer"], client=api.client) as client:
        await client.take_over(api.run)
        assert await client.delete_run(api.run) == {"run": api.run, "deleted": True}
        assert api.run not in client.controller_epochs
        with pytest.raises(UnknownRun):
            await client.get_run(api.run)
