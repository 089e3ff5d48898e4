"""Retention never takes a result: the log is trimmed below the retained checkpoints and older
manifests expire, yet an unacknowledged result stays readable (the catalog keeps its own copy),
across a service restart too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests import factories as f
from tests.api.conftest import RUN, Api, open_api, settings_for

pytestmark = pytest.mark.slow


async def results(api: Api, **params: Any) -> list[dict[str, Any]]:
    response = await api.call("GET", f"/v1/runs/{RUN}/results", "trainer", 200, params=params)
    return [orjson.loads(line) for line in response.content.splitlines() if line]


async def finished_record_kept(api: Api, episode: str) -> bool:
    _, records, _ = await api.service.coordinator.episode_records(RUN, episode)
    return any(orjson.loads(r.split(b"\n")[0])["type"] == "episode.finished" for _, r in records)


async def test_an_unacknowledged_result_outlives_log_and_manifest_retention(
    tmp_path: Path,
) -> None:
    settings = settings_for(tmp_path / "data")
    async with open_api(settings) as api:
        await api.seed(["x", "y"])
        await api.append(f.finished("x", 0.5, {"answer": 42}))
        first = await api.checkpoint()
        assert first["counts"]["finished"] == 1
        await api.append(f.finished("y", 1.0))
        # Two more checkpoints with nothing live: retention (keep 2) expires the first one's
        # manifest and the log is trimmed below the newer cuts, x's finish included.
        for _ in range(2):
            await api.checkpoint()
        for _ in range(100):
            if not await finished_record_kept(api, "x"):
                break
            await asyncio.sleep(0.05)
        assert not await finished_record_kept(api, "x"), "the log was not trimmed below x"
        manifest = await api.call(
            "GET", f"/v1/runs/{RUN}/checkpoints/{first['checkpoint_id']}/manifest", "analyst"
        )
        assert manifest.status_code == 404  # expired
        kept = await results(api, unacknowledged="true")
        assert [(r["episode"], r["reward"], r["result"]) for r in kept] == [
            ("x", 0.5, {"answer": 42}),
            ("y", 1.0, None),
        ]
    async with open_api(settings) as api:  # a restarted service reads them from the catalog
        assert await results(api, unacknowledged="true") == kept
        acked = await api.call(
            "POST", f"/v1/runs/{RUN}/results/ack", "trainer", 200, json={"episodes": ["x"]}
        )
        assert acked.json()["acknowledged"] == 1
        assert [r["episode"] for r in await results(api, unacknowledged="true")] == ["y"]
        history = await api.call("GET", f"/v1/runs/{RUN}/episodes/x", "analyst", 200)
        assert history.json()["result"]["acknowledged"] is True
