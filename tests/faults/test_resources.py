"""Bounded resources: the embedded service under a low descriptor limit, with
many runs and one run with the most partitions allowed, and runs deleted to free their files.

Before the fix every partition's follower held a SQLite connection for good and every run a
writer and a checkpointer thread: at the default NOFILE of 1024 the 28th run of 16 partitions made
the service refuse connections and unable to restart. Here the service starts with NOFILE 256 and
gets 40 runs of 16 partitions (640 partitions) plus one of ``MAX_PARTITIONS``; it must keep
answering, hold a bounded number of descriptors and threads, and restart.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutlog.log._interface import MAX_PARTITIONS
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import TOKENS
from tests.faults._embedded import Client, LimitedService

NOFILE = 256
CLI = (sys.executable, "-m", "rolloutlog.api.cli")
RUNS = 40

pytestmark = pytest.mark.slow


async def fill(client: Client, run: str, episodes: int) -> None:
    epoch = await client.register(run)
    who = f.participant(epoch=epoch)
    events = [f.started(f"{run}-e{i}", who=who) for i in range(episodes)]
    reply = await client.append(run, events)
    assert reply.status_code == 200, reply.text


async def test_many_runs_and_the_widest_run_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    service = LimitedService(data_dir, tmp_path, {resource.RLIMIT_NOFILE: NOFILE})
    await service.start()
    client = Client(service.url)
    try:
        for index in range(RUNS):
            await client.create_run(f"run-{index}", 16)
            await fill(client, f"run-{index}", 8)
        await client.create_run("widest", MAX_PARTITIONS)
        await fill(client, "widest", 4 * MAX_PARTITIONS)
        reply = await client.call(
            "POST", "/v1/runs", "trainer", 400, json={"run": "wider", "partitions": 257}
        )
        assert reply.json()["error"]["code"] == "invalid_request"

        await client.call("GET", "/readyz", expect=200)
        runs = (await client.call("GET", "/v1/runs", expect=200)).json()["runs"]
        assert len(runs) == RUNS + 1
        epoch = await client.take_over("widest")
        assert (await client.checkpoint("widest", epoch, wait=True))["status"] == "committed"
        # Bounded: far below the limit, and threads do not grow with runs x partitions.
        assert service.open_descriptors() < NOFILE * 3 // 4
        assert service.threads() < 40

        # A deleted run (here with the CLI) releases its files; a fresh run reuses the name.
        deleted = await asyncio.to_thread(
            subprocess.run,
            [*CLI, "runs", "delete", "run-0", "--url", service.url, "--token", TOKENS["trainer"]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert deleted.returncode == 0, deleted.stderr
        assert deleted.stdout.strip() == "deleted run run-0"
        assert not (data_dir / "log" / "run-0.sqlite3").exists()
        await client.call("GET", "/v1/runs/run-0", expect=404)
        await client.create_run("run-0", 4)
        await fill(client, "run-0", 2)

        service.kill()
        await service.start()  # the restart follows all 41 runs again under the same limit
        await client.call("GET", "/readyz", expect=200)
        epoch = await client.take_over("run-1")
        assert (await client.checkpoint("run-1", epoch, wait=True))["status"] == "committed"
        assert service.open_descriptors() < NOFILE * 3 // 4
    finally:
        await client.aclose()
        service.stop()
