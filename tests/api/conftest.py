"""The app in process: an embedded log and a SQLite catalog in tmp_path, its lifespan run, and an
httpx client over ``ASGITransport`` with a token per role."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.api import Settings, Tokens, create_app
from rolloutlog.api._service import Service
from rolloutlog.log import Event, encode_event
from tests import factories as f

TOKENS = {
    "participant": "participant-token-0001",
    "trainer": "trainer-token-00000001",
    "analyst": "analyst-token-00000001",
    "admin": "admin-token-0000000001",
}
RUN = "run"


def bearer(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[role]}"}


def wire(*events: Event) -> list[dict[str, Any]]:
    """Events as a client sends them."""
    return [orjson.loads(encode_event(event)) for event in events]


@dataclass
class Api:
    client: httpx.AsyncClient
    service: Service
    run: str = RUN
    epoch: int = 0

    async def call(
        self, method: str, url: str, role: str = "admin", expect: int | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {**bearer(role), **kw.pop("headers", {})}
        response = await self.client.request(method, url, headers=headers, **kw)
        if expect is not None:
            assert response.status_code == expect, response.text
        return response

    async def create_run(self, run: str = RUN, partitions: int = 4) -> httpx.Response:
        return await self.call(
            "POST", "/v1/runs", "trainer", json={"run": run, "partitions": partitions}
        )

    async def register(self, pid: str = "env-0", kind: str = "environment") -> int:
        response = await self.call(
            "POST",
            f"/v1/runs/{self.run}/participants",
            "participant",
            201,
            json={"id": pid, "kind": kind},
        )
        epoch: int = response.json()["epoch"]
        return epoch

    async def append(self, *events: Event, expect: int = 200) -> httpx.Response:
        return await self.call(
            "POST", f"/v1/runs/{self.run}/events", "participant", expect, json=wire(*events)
        )

    async def take_over(self) -> int:
        response = await self.call("POST", f"/v1/runs/{self.run}/controller", "trainer", 200)
        self.epoch = response.json()["controller_epoch"]
        return self.epoch

    async def checkpoint(self, expect: int = 201, **body: Any) -> dict[str, Any]:
        body.setdefault("controller_epoch", self.epoch)
        response = await self.call(
            "POST", f"/v1/runs/{self.run}/checkpoints", "trainer", expect, json=body
        )
        result: dict[str, Any] = response.json()
        return result

    async def restore(self, expect: int = 201, **body: Any) -> dict[str, Any]:
        body.setdefault("controller_epoch", self.epoch)
        body.setdefault("checkpoint_id", "latest")
        response = await self.call(
            "POST", f"/v1/runs/{self.run}/restores", "trainer", expect, json=body
        )
        result: dict[str, Any] = response.json()
        return result

    async def log_ends(self) -> list[int]:
        return await self.service.log.end_offsets(self.run)

    async def seed(self, episodes: Sequence[str] = ("a",)) -> None:
        """A run with a controller, a registered environment and a live episode each."""
        await self.create_run()
        await self.register()
        await self.take_over()
        for episode in episodes:
            await self.append(f.started(episode), f.boundary(episode, "seed", {"turn": 1}))


def settings_for(data_dir: Path, **kw: Any) -> Settings:
    return Settings(data_dir=data_dir, tokens=Tokens.from_mapping(TOKENS, "test"), **kw)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with open_api(settings_for(tmp_path / "data")) as opened:
        yield opened


class open_api:  # used like a function: ``async with open_api(settings) as api``
    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self._lifespan: Any = None
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Api:
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        transport = httpx.ASGITransport(app=self.app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://rolloutlog.test")
        return Api(self._client, self.app.state.service)

    async def __aexit__(self, *exc: object) -> None:
        assert self._client is not None
        await self._client.aclose()
        await self._lifespan.__aexit__(None, None, None)
