"""Two services on one embedded data directory, with real processes.

Asserts: the second ``rolloutlog serve`` exits non-zero with one clear line on stderr and touches
nothing (the first one's pending checkpoint stays pending, no file of the data directory changes);
after the first is SIGKILLed the kernel has dropped its lock and a restart on the same directory
comes up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import factories as f
from tests._services import ROOT
from tests.faults._embedded import Client, LimitedService

RUN = "locked"

pytestmark = pytest.mark.slow


def snapshot(data_dir: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under the data directory but the lock file."""
    return {
        str(path.relative_to(data_dir)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(data_dir.rglob("*"))
        if path.is_file() and path.name != "lock"
    }


async def test_second_service_on_a_data_dir_refuses_and_touches_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = LimitedService(data_dir, tmp_path)
    await first.start()
    client = Client(first.url)
    try:
        await client.create_run(RUN, 2)
        epoch = await client.register(RUN)
        controller = await client.take_over(RUN)
        who = f.participant(epoch=epoch)
        # An open wait step keeps the checkpoint pending until its deadline.
        reply = await client.append(
            RUN, [f.started("e1", who=who), f.step_started("e1", "close_agent", "wait", who=who)]
        )
        assert reply.status_code == 200, reply.text
        pending = await client.checkpoint(RUN, controller, 202, deadline_s=120, wait=False)
        assert pending["status"] == "pending"
        # Frozen (still holding its lock), the first service writes nothing meanwhile.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            before = snapshot(data_dir)
            second = LimitedService(data_dir, tmp_path)
            started = time.monotonic()
            refused = await asyncio.to_thread(
                subprocess.run,
                second.command(),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            refused_after = time.monotonic() - started
            after = snapshot(data_dir)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert refused.returncode != 0
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1, refused.stderr
        assert "in use" in lines[0] and str(data_dir) in lines[0], lines[0]

        assert after == before
        assert refused_after < 30, "it waited for the lock instead of refusing"
        path = f"/v1/runs/{RUN}/checkpoints/{pending['checkpoint_id']}"
        still = await client.call("GET", path, "analyst", 200)
        assert still.json()["status"] == "pending"

        # The lock dies with its holder: a SIGKILLed service does not block its restart.
        first.kill()
        restarted = LimitedService(data_dir, tmp_path)
        await restarted.start()
        restarted.stop()
        assert restarted.proc is not None and restarted.proc.returncode == 0
    finally:
        await client.aclose()
        first.stop()
