from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rolloutlog.catalog import Catalog, open_catalog
from rolloutlog.log import Event, Log, Position, open_log
from rolloutlog.projections import Coordinator


@dataclass
class Service:
    """An embedded log, a SQLite catalog and a coordinator over one data directory."""

    data_dir: Path
    log: Log
    catalog: Catalog
    coordinator: Coordinator
    run: str = "run"
    epoch: int = 0
    seqs: dict[tuple[str, int], int] = field(default_factory=dict)

    async def append(self, *events: Event) -> list[Position]:
        return await self.log.append(self.run, list(events))

    async def checkpoint(self, **kw: Any) -> Any:
        return await self.coordinator.checkpoint(self.run, self.epoch, **kw)

    async def restore(self, **kw: Any) -> Any:
        return await self.coordinator.restore(self.run, self.epoch, **kw)

    async def close(self) -> None:
        await self.coordinator.stop()
        await self.catalog.stop()
        await self.log.close()


async def open_service(
    data_dir: Path,
    partitions: int = 4,
    *,
    log_url: str | None = None,
    catalog_url: str | None = None,
    **catalog_kw: Any,
) -> Service:
    """Embedded log and SQLite catalog under ``data_dir`` unless URLs say otherwise."""
    log = open_log(log_url or f"embedded://{data_dir}")
    await log.start()
    catalog = open_catalog(
        catalog_url or f"sqlite+aiosqlite:///{data_dir}/catalog.sqlite3", **catalog_kw
    )
    await catalog.start()
    coordinator = Coordinator(log, catalog)
    await coordinator.start()
    service = Service(data_dir, log, catalog, coordinator)
    await coordinator.create_run("run", partitions)
    service.epoch = (await catalog.get_run("run")).controller_epoch
    if service.epoch == 0:
        service.epoch = await catalog.take_over_controller("run")
    return service


@pytest.fixture(
    params=[
        "embedded+sqlite",
        pytest.param("kafka+postgres", marks=[pytest.mark.kafka, pytest.mark.postgres]),
    ]
)
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Where a service keeps its log and catalog: embedded files, or Kafka and PostgreSQL."""
    if request.param == "embedded+sqlite":
        return {}
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    return {
        "log_url": f"kafka://{bootstrap}?topic_prefix=t{uuid.uuid4().hex[:10]}.",
        "catalog_url": request.getfixturevalue("postgres_schema"),
    }


@pytest.fixture
async def service(tmp_path: Path, deployment: dict[str, Any]) -> AsyncIterator[Service]:
    svc = await open_service(tmp_path, **deployment)
    try:
        yield svc
    finally:
        await svc.close()
