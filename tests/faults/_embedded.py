"""Fixtures of the embedded faults (full disk, descriptor limit, data-dir lock): a real ``rolloutlog
serve`` process on an embedded data directory, its resource limits set or changed from outside,
and a small REST client for it."""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from rolloutlog.log import Event, Log, encode_event, encode_record, open_log
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.faults._api import with_limits


class LimitedService(Service):
    """``Service`` whose process starts with the given resource limits (``{RLIMIT_X: n}``, soft
    and hard: ``serve`` raises its soft open-file limit to the hard one); ``set_limit`` changes
    one of them while it runs (``prlimit`` on its pid)."""

    def __init__(self, data_dir: Path, workdir: Path, limits: dict[int, int] | None = None) -> None:
        super().__init__(Deployment("embedded", data_dir), workdir)
        self.limits = dict(limits or {})

    def _spawn(self, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
        return super()._spawn(with_limits({which: (n, n) for which, n in self.limits.items()}))

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        return self.proc.pid

    def set_limit(self, which: int, soft: int) -> None:
        _, hard = resource.prlimit(self.pid, which)
        resource.prlimit(self.pid, which, (soft, hard))

    def open_descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))


class Client:
    """The REST calls these tests make, with the right role's token each."""

    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=60)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(
        self, method: str, path: str, role: str = "admin", expect: int | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKENS[role]}", **kw.pop("headers", {})}
        response = await self.http.request(method, path, headers=headers, **kw)
        if expect is not None:
            assert response.status_code == expect, response.text
        return response

    async def create_run(self, run: str, partitions: int = 2) -> None:
        body = {"run": run, "partitions": partitions}
        await self.call("POST", "/v1/runs", "trainer", 201, json=body)

    async def register(self, run: str, pid: str = "env-0") -> int:
        body = {"id": pid, "kind": "environment"}
        reply = await self.call(
            "POST", f"/v1/runs/{run}/participants", "participant", 201, json=body
        )
        epoch: int = reply.json()["epoch"]
        return epoch

    async def take_over(self, run: str) -> int:
        reply = await self.call("POST", f"/v1/runs/{run}/controller", "trainer", 200)
        epoch: int = reply.json()["controller_epoch"]
        return epoch

    async def append(self, run: str, events: Sequence[Event]) -> httpx.Response:
        body = b"[" + b",".join(encode_event(event) for event in events) + b"]"
        return await self.call(
            "POST",
            f"/v1/runs/{run}/events",
            "participant",
            content=body,
            headers={"Content-Type": "application/json"},
        )

    async def checkpoint(self, run: str, epoch: int, expect: int = 201, **body: Any) -> Any:
        reply = await self.call(
            "POST",
            f"/v1/runs/{run}/checkpoints",
            "trainer",
            expect,
            json={"controller_epoch": epoch, **body},
        )
        return orjson.loads(reply.content)


async def log_records(data_dir: Path, run: str) -> dict[int, list[bytes]]:
    """Every record of the run's embedded log, per partition (the service must be stopped: the
    log takes the data directory's lock)."""
    log: Log = open_log(data_dir)
    async with log:
        ends = await log.end_offsets(run)
        return {
            partition: [value async for _, value in log.read_records(run, partition, 0, end)]
            for partition, end in enumerate(ends)
        }


def as_stored(event: Event) -> bytes:
    """The record the service stores for an event it acknowledged."""
    return encode_record(event)
