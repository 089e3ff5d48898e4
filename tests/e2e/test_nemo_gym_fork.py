"""A fork resumed by the collector on real NeMo Gym 0.4.0 servers, on both deployments (on
the distributed one every participant and the collector append straight to Kafka).

Run ``a`` collects four rows on its Gym (a restart-only counter and a stateless multi-step
environment behind the integration's SimpleAgent, its vllm_model policy at version 0 on the fake
backend); two rows are held mid-rollout at the backend (after their first tool round) when the
collector checkpoints on SIGUSR1. Run ``b`` is forked from that checkpoint by the collector
command (``--fork-from``) and served by a second set of NeMo Gym processes attached to ``b``, its
policy at version 1: the two in-flight rows go on in ``b`` as its next attempt (the counter's
starts over, the stateless one continues) and are written, with the rewards of an uninterrupted
run, into ``b``'s own output while ``a``'s are still held. Released, ``a`` finishes its own rows:
every reward right, its episodes' history as at the fork, its generations version 0 only.
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

from rolloutlog.integrations.nemo_gym import episode_id
from tests.api.conftest import TOKENS
from tests.e2e._harness import Service
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SOURCE, FORK = "gym-a", "gym-a-b"
ROWS = [counter_row(0), counter_row(1, right=False), steps_row(0, right=False), steps_row(1)]
EXPECTED = {"t0-r0": 1.0, "t1-r0": 0.0, "t2-r0": 0.0, "t3-r0": 1.0}
#: prompt -> its row's episode: held mid-rollout in the source, so in flight at its checkpoint
HELD = {"counter task 1:": "t1-r0", "steps task 1:": "t3-r0"}
AGENTS = ("counter_agent", "steps_agent")


class World:
    def __init__(self, service: Service, backend: Backend, workdir: Path) -> None:
        self.service = service
        self.backend = backend
        self.workdir = workdir
        self.dataset = workdir / "dataset.jsonl"
        self.dataset.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in ROWS))

    async def gym(self, run: str, policy_version: int) -> GymProcesses:
        """A set of NeMo Gym servers attached to ``run``, its policy at ``policy_version``."""
        config = gym_config(self.service.url, run, self.backend)
        if self.service.deployment.distributed:
            config["rolloutlog"]["kafka"] = self.service.deployment.log_url
        for agent in AGENTS:  # the integration's agent and policy: they record the calls
            config[agent]["responses_api_agents"]["simple_agent"]["rolloutlog"] = {
                "server_class": "rolloutlog.integrations.nemo_gym:RolloutlogSimpleAgent"
            }
        config["policy_model"]["responses_api_models"]["vllm_model"]["rolloutlog"] = {
            "server_class": "rolloutlog.integrations.nemo_gym:RolloutlogVLLMModel",
            "policy_version": policy_version,
        }
        gym = GymProcesses(self.workdir / run, config)
        await gym.launch()
        return gym

    def collector(self, run: str, gym: GymProcesses, *options: str) -> subprocess.Popen[bytes]:
        return start_collector(
            self.dataset,
            self.output(run),
            self.workdir / f"collector-{run}.log",
            service_url=self.service.url,
            run=run,
            agents={agent: gym.url(agent) for agent in AGENTS},
            kafka=self.service.deployment.log_url,
            options=options,
        )

    def output(self, run: str) -> Path:
        return self.workdir / f"{run}.jsonl"

    def rewards(self, run: str) -> dict[str, float]:
        """Episode -> reward of the run's output; each row written once."""
        rows = [orjson.loads(line) for line in self.output(run).read_bytes().splitlines()]
        assert all(n == 1 for n in Counter(episode_id(row) for row in rows).values()), rows
        return {episode_id(row): float(row["reward"]) for row in rows}

    async def get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {TOKENS['admin']}"}
        async with httpx.AsyncClient(headers=headers) as http:
            reply = await http.get(f"{self.service.url}/v1/runs/{path}")
            reply.raise_for_status()
            return reply.json()


@pytest.fixture
def venv() -> Path:
    """The NeMo Gym venv (asked for first: without one, no service is started)."""
    return gym_python()


@pytest.fixture
async def nemo(venv: Path, service: Service, tmp_path: Path) -> AsyncIterator[World]:
    backend = Backend(tmp_path)
    try:
        await backend.start()
        yield World(service, backend, tmp_path)
    finally:
        backend.stop()


def versions(history: dict[str, Any]) -> set[tuple[int, int]]:
    """(attempt, policy version) of the generation calls an episode's history shows."""
    return {(call["attempt"], call["policy_version"]) for call in history["generation_calls"]}


async def committed(nemo: World, run: str) -> list[int]:
    body = await nemo.get(f"{run}/checkpoints")
    found = body["checkpoints"] if isinstance(body, dict) else body
    return [c["checkpoint_id"] for c in found if c["status"] == "committed"]


async def test_the_collector_resumes_a_fork_on_its_own_gym(nemo: World) -> None:
    gyms: list[GymProcesses] = []
    source: subprocess.Popen[bytes] | None = None
    try:
        gyms.append(source_gym := await nemo.gym(SOURCE, 0))
        for prompt in HELD:
            await nemo.backend.hold(prompt, turn=1)  # after the first tool round
        source = nemo.collector(SOURCE, source_gym)
        await nemo.backend.wait_parked(len(HELD))
        deadline = time.monotonic() + 120
        while not nemo.output(SOURCE).exists() or len(nemo.rewards(SOURCE)) < 2:
            assert time.monotonic() < deadline, "the source's free rows are not written"
            await asyncio.sleep(0.1)
        before = max(await committed(nemo, SOURCE))
        source.send_signal(signal.SIGUSR1)  # checkpoint with the held rows in flight
        while max(await committed(nemo, SOURCE)) <= before:
            assert time.monotonic() < deadline, "no checkpoint on SIGUSR1"
            await asyncio.sleep(0.1)
        checkpoint = max(await committed(nemo, SOURCE))
        # The baseline once the catalog has recorded the held episodes' starts (its feeders do
        # so within a second of the fold): nothing else may change in them while the fork runs.
        while True:
            history_before = {e: await nemo.get(f"{SOURCE}/episodes/{e}") for e in HELD.values()}
            if all(h["started_at"] is not None for h in history_before.values()):
                break
            assert time.monotonic() < deadline, "the held episodes' starts are not recorded"
            await asyncio.sleep(0.2)

        gyms.append(fork_gym := await nemo.gym(FORK, 1))  # the fork's own NeMo Gym processes
        options = ("--fork-from", SOURCE, "--fork-checkpoint", str(checkpoint))
        options += ("--policy-version", "1")
        log = await finish_collector(
            nemo.collector(FORK, fork_gym, *options), nemo.workdir / f"collector-{FORK}.log",
            fork_gym,
        )  # fmt: skip
        assert nemo.rewards(FORK) == {e: EXPECTED[e] for e in HELD.values()}, log
        # the restart-only counter's row starts over in the fork, the stateless one continues
        assert "continued 1, restarted 1" in log and "not forked 2" in log, log
        fork = await nemo.get(FORK)
        assert fork["forked_from"]["run"] == SOURCE
        assert fork["forked_from"]["checkpoint_id"] == checkpoint
        assert [f["run"] for f in (await nemo.get(SOURCE))["forks"]] == [FORK]
        for episode in HELD.values():  # continued in the fork under its policy's version
            history = await nemo.get(f"{FORK}/episodes/{episode}")
            assert (1, 1) in versions(history), history["generation_calls"]
        # the source is untouched: its held rows still in flight, their history as it was
        assert set(nemo.rewards(SOURCE)) == set(EXPECTED) - set(HELD.values())
        for episode, history in history_before.items():
            assert await nemo.get(f"{SOURCE}/episodes/{episode}") == history

        await nemo.backend.release()  # the source's own rows go on, on its own Gym
        await finish_collector(source, nemo.workdir / f"collector-{SOURCE}.log", source_gym)
        assert nemo.rewards(SOURCE) == EXPECTED
        for episode in HELD.values():  # the source's rows are its own policy's only
            history = await nemo.get(f"{SOURCE}/episodes/{episode}")
            assert {v for _, v in versions(history)} == {0}, history["generation_calls"]
        assert nemo.rewards(FORK) == {e: EXPECTED[e] for e in HELD.values()}
    finally:
        if source is not None and source.poll() is None:
            kill_group(source.pid)
            source.wait()
        await nemo.backend.release()
        for gym in gyms:
            gym.stop()
