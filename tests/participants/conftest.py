"""The service in process (embedded log, SQLite catalog in tmp_path) with SDK and trainer clients
over ``httpx.ASGITransport``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rolloutlog.participants import HttpTransport, Restores
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS, Api, open_api, settings_for

RUN = "run"


@dataclass
class World:
    api: Api
    transport: HttpTransport
    trainer: AsyncTrainerClient
    restores: Restores


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with open_api(settings_for(tmp_path / "data")) as api:
        trainer = AsyncTrainerClient(client=api.client, token=TOKENS["trainer"])
        await trainer.create_run(RUN, partitions=4)
        await trainer.take_over(RUN)
        restores = Restores(client=api.client, token=TOKENS["participant"])
        async with HttpTransport(client=api.client, token=TOKENS["participant"]) as transport:
            yield World(api, transport, trainer, restores)
