"""Real NeMo Gym 0.4.0 servers (from the cached venv, started by the launcher without Ray) behind
rolloutlog, crashed: a restart-only resources server (example_session_state_mgmt, state in the
process) and a stateless one (example_multi_step), each behind a stock SimpleAgent, one vllm_model
policy on the fake backend, the collector as the trainer.

Rows are held mid-rollout at the backend (after their first tool round), the collector takes a
checkpoint on SIGUSR1, then every NeMo Gym process group and the collector are SIGKILLed; the
Gym is launched again and the same collector command resumes: every row is written exactly once
with the reward of an uninterrupted reference run. SIGTERM checkpoints and stops instead.
Embedded deployment (the crash suite runs the distributed one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.integrations.nemo_gym import episode_id
from rolloutlog.participants.sim import die_with_parent
from tests._services import ROOT
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.integrations.nemo_gym._gym import (
    Backend,
    GymProcesses,
    counter_row,
    gym_config,
    gym_python,
    kill_group,
    steps_row,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUN = "gym"
#: (row, held mid-rollout at turn 1 in the crash run)
ROWS = [
    *(counter_row(i, right=i != 2) for i in range(4)),
    *(steps_row(i, right=i != 1) for i in range(4)),
]
HELD = ["counter task 0:", "counter task 3:", "steps task 1:", "steps task 2:"]


class World:
    def __init__(self, service: Service, backend: Backend, gym: GymProcesses, workdir: Path):
        self.service = service
        self.backend = backend
        self.gym = gym
        self.workdir = workdir
        self.dataset = workdir / "dataset.jsonl"
        self.dataset.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in ROWS))

    def collector(self, run: str, output: Path) -> subprocess.Popen[bytes]:
        """``python -m rolloutlog.integrations.nemo_gym collect`` in its own session."""
        command = [sys.executable, "-m", "rolloutlog.integrations.nemo_gym", "collect"]
        command += ["--input", str(self.dataset), "--output", str(output), "--run", run]
        command += ["--url", self.service.url, "--token", TOKENS["admin"], "--concurrency", "8"]
        for agent in ("counter_agent", "steps_agent"):
            command += ["--agent-url", f"{agent}={self.gym.url(agent)}"]
        with open(self.workdir / f"collector-{run}.log", "ab") as log:
            return subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def log(self, run: str) -> str:
        return (self.workdir / f"collector-{run}.log").read_text(errors="replace")

    async def finish(self, proc: subprocess.Popen[bytes], run: str) -> str:
        code = await asyncio.to_thread(proc.wait, 600)
        assert code == 0, f"collector exit {code}: {self.log(run)[-3000:]}\n{self.gym.tail()}"
        return self.log(run)


@pytest.fixture(scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    gym_python()
    workdir = tmp_path_factory.mktemp("nemo_gym")
    service = Service(Deployment("embedded", workdir / "data"), workdir)
    await service.start()
    backend = Backend(workdir)
    gym: GymProcesses | None = None
    try:
        await backend.start()
        gym = GymProcesses(workdir, gym_config(service.url, RUN, backend))
        await gym.launch()
        yield World(service, backend, gym, workdir)
    finally:
        if gym is not None:
            gym.stop()
        backend.stop()
        service.stop()


def rewards(path: Path) -> dict[str, float]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    counts = Counter(episode_id(row) for row in rows)
    assert set(counts.values()) == {1}, f"rows written twice: {counts}"
    return {episode_id(row): float(row["reward"]) for row in rows}


async def reference(world: World) -> dict[str, float]:
    output = world.workdir / "reference.jsonl"
    if not output.exists():
        await world.finish(world.collector("reference", output), "reference")
    return rewards(output)


async def test_an_uninterrupted_run_gets_the_expected_rewards(world: World) -> None:
    expected = {f"t{i}-r0": 0.0 if i in (2, 5) else 1.0 for i in range(len(ROWS))}
    assert await reference(world) == expected


async def checkpoints(world: World, run: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKENS['admin']}"}) as http:
        reply = await http.get(f"{world.service.url}/v1/runs/{run}/checkpoints")
        reply.raise_for_status()
        body = reply.json()
    found: list[dict[str, Any]] = body["checkpoints"] if isinstance(body, dict) else body
    return found


async def wait_checkpoints(world: World, run: str, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        committed = [c for c in await checkpoints(world, run) if c["status"] == "committed"]
        if len(committed) >= count:
            return
        assert time.monotonic() < deadline, f"{len(committed)} of {count} checkpoints"
        await asyncio.sleep(0.1)


async def test_sigkill_of_every_process_group_then_resume(world: World) -> None:
    expected = await reference(world)
    run, output = "crash", world.workdir / "crash.jsonl"
    for prompt in HELD:
        await world.backend.hold(prompt, turn=1)  # after the first tool round
    collector = world.collector(run, output)
    await world.backend.wait_parked(len(HELD))
    deadline = time.monotonic() + 120
    while not output.exists() or len(output.read_bytes().splitlines()) < len(ROWS) - len(HELD):
        assert time.monotonic() < deadline, world.log(run)
        await asyncio.sleep(0.1)
    collector.send_signal(signal.SIGUSR1)  # checkpoint, and go on
    await wait_checkpoints(world, run, 2)  # the one before dispatch, and this one
    kill_group(collector.pid)
    world.gym.kill()
    collector.wait()
    await world.backend.release()  # the parked calls answer dead sockets
    calls_before = len(world.backend.calls())
    await world.gym.launch()
    log = await world.finish(world.collector(run, output), run)
    assert rewards(output) == expected
    assert f"already done {len(ROWS) - len(HELD)}" in log
    # a stock SimpleAgent has no session hooks: each held row replays its /run from its input
    assert "continued 4" in log, log
    replayed = world.backend.calls()[calls_before:]
    assert sorted(c["prompt"].split(":")[0] for c in replayed if c["turn"] == 0) == sorted(
        p.rstrip(":") for p in HELD
    )


async def test_sigterm_checkpoints_and_stops_then_resumes(world: World) -> None:
    expected = await reference(world)
    run, output = "stop", world.workdir / "stop.jsonl"
    await world.backend.hold("counter task 1:", turn=1)
    collector = world.collector(run, output)
    await world.backend.wait_parked(1)
    collector.send_signal(signal.SIGTERM)
    log = await world.finish(collector, run)
    assert "stopped on SIGTERM" in log
    await world.backend.release()
    assert len(await checkpoints(world, run)) == 2
    await world.finish(world.collector(run, output), run)
    assert rewards(output) == expected
