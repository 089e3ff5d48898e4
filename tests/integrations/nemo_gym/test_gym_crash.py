"""Real NeMo Gym 0.4.0 servers (from the cached venv, started by the launcher without Ray) behind
rolloutlog, crashed: a restart-only resources server (example_session_state_mgmt, state in the
process) and a stateless one (example_multi_step), each behind a stock SimpleAgent, one vllm_model
policy on the fake backend, the collector as the trainer.

Rows are held mid-rollout at the backend (after their first tool round), the collector takes a
checkpoint on SIGUSR1, then every NeMo Gym process group and the collector are SIGKILLed; the
Gym is launched again and the same collector command resumes: every row is written exactly once
with the reward of an uninterrupted reference run. SIGTERM checkpoints and stops instead.
Embedded deployment (the crash suite runs the distributed one). The Gym's servers record into one
rolloutlog run, so each scenario collects the same rows under task indices of its own
(``_ng_task_index`` from 0, 100, 200: distinct episodes).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

from rolloutlog.integrations.nemo_gym import episode_id
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.integrations.nemo_gym._gym import (
    Backend,
    GymProcesses,
    counter_row,
    finish_collector,
    gym_config,
    gym_python,
    kill_group,
    start_collector,
    steps_row,
)

# one Gym for the module: its tests share the module's event loop
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]
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

    def collector(self, scenario: int, output: Path) -> subprocess.Popen[bytes]:
        """``python -m rolloutlog.integrations.nemo_gym collect`` in its own session, over the
        rows with task indices from ``scenario``."""
        dataset = self.workdir / f"dataset-{scenario}.jsonl"
        dataset.write_bytes(
            b"".join(
                orjson.dumps({**row, "_ng_task_index": scenario + i}) + b"\n"
                for i, row in enumerate(ROWS)
            )
        )
        return start_collector(
            dataset,
            output,
            self.workdir / f"collector-{scenario}.log",
            service_url=self.service.url,
            run=RUN,
            agents={agent: self.gym.url(agent) for agent in ("counter_agent", "steps_agent")},
        )

    def log(self, scenario: int) -> str:
        return (self.workdir / f"collector-{scenario}.log").read_text(errors="replace")

    async def finish(self, proc: subprocess.Popen[bytes], scenario: int) -> str:
        return await finish_collector(proc, self.workdir / f"collector-{scenario}.log", self.gym)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nemo(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
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


def rewards(path: Path) -> dict[int, float]:
    """Row (its task index within its scenario) -> reward; each row written exactly once."""
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    counts = Counter(episode_id(row) for row in rows)
    assert set(counts.values()) == {1}, f"rows written twice: {counts}"
    return {row["_ng_task_index"] % 100: float(row["reward"]) for row in rows}


async def reference(nemo: World) -> dict[int, float]:
    output = nemo.workdir / "reference.jsonl"
    if not output.exists():
        await nemo.finish(nemo.collector(0, output), 0)
    return rewards(output)


async def test_an_uninterrupted_run_gets_the_expected_rewards(nemo: World) -> None:
    expected = {i: 0.0 if i in (2, 5) else 1.0 for i in range(len(ROWS))}
    assert await reference(nemo) == expected


async def checkpoints(nemo: World) -> list[dict[str, Any]]:
    """The run's committed checkpoints."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKENS['admin']}"}) as http:
        reply = await http.get(f"{nemo.service.url}/v1/runs/{RUN}/checkpoints")
        reply.raise_for_status()
        body = reply.json()
    found: list[dict[str, Any]] = body["checkpoints"] if isinstance(body, dict) else body
    return [c for c in found if c["status"] == "committed"]


async def latest(nemo: World) -> int:
    """The newest committed checkpoint's id (the service keeps the newest two)."""
    return max((c["checkpoint_id"] for c in await checkpoints(nemo)), default=0)


async def wait_checkpoint(nemo: World, after: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while await latest(nemo) <= after:
        assert time.monotonic() < deadline, f"no checkpoint after {after}"
        await asyncio.sleep(0.1)


async def test_sigkill_of_every_process_group_then_resume(nemo: World) -> None:
    expected = await reference(nemo)
    scenario, output = 100, nemo.workdir / "crash.jsonl"
    for prompt in HELD:
        await nemo.backend.hold(prompt, turn=1)  # after the first tool round
    collector = nemo.collector(scenario, output)
    await nemo.backend.wait_parked(len(HELD))
    deadline = time.monotonic() + 120
    while not output.exists() or len(output.read_bytes().splitlines()) < len(ROWS) - len(HELD):
        assert time.monotonic() < deadline, nemo.log(scenario)
        await asyncio.sleep(0.1)
    before = await latest(nemo)
    collector.send_signal(signal.SIGUSR1)  # checkpoint, and go on
    await wait_checkpoint(nemo, before)
    kill_group(collector.pid)
    nemo.gym.kill()
    collector.wait()
    await nemo.backend.release()  # the parked calls answer dead sockets
    calls_before = len(nemo.backend.calls())
    await nemo.gym.launch()
    log = await nemo.finish(nemo.collector(scenario, output), scenario)
    assert rewards(output) == expected
    assert f"already done {len(ROWS) - len(HELD)}" in log
    # a stock SimpleAgent has no session hooks: each held row replays its /run from its input
    assert "continued 4" in log, log
    replayed = nemo.backend.calls()[calls_before:]
    assert sorted(c["prompt"].split(":")[0] for c in replayed if c["turn"] == 0) == sorted(
        p.rstrip(":") for p in HELD
    )


async def test_sigterm_checkpoints_and_stops_then_resumes(nemo: World) -> None:
    expected = await reference(nemo)
    scenario, output = 200, nemo.workdir / "stop.jsonl"
    await nemo.backend.hold("counter task 1:", turn=1)
    collector = nemo.collector(scenario, output)
    await nemo.backend.wait_parked(1)
    before = await latest(nemo)
    collector.send_signal(signal.SIGTERM)
    log = await nemo.finish(collector, scenario)
    assert "stopped on SIGTERM" in log
    await nemo.backend.release()
    assert await latest(nemo) > before
    await nemo.finish(nemo.collector(scenario, output), scenario)
    assert rewards(output) == expected
