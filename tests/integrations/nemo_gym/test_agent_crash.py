"""Real NeMo Gym 0.4.0 servers (``RolloutlogSimpleAgent``, ``RolloutlogVLLMModel`` streaming from
the fake backend, the stateless ``example_multi_step``; started by the launcher without Ray):
rollouts with tool rounds parked at the backend mid-loop, a checkpoint, every NeMo Gym process
group SIGKILLed, a restore, the Gym launched again, replacements. The test plays the environment
(``episode.started``, seed, the agent's loop, verify) and asserts the backend's exact call log,
the lineage of the replacement calls, and that every continued rollout ends as an uninterrupted
reference run of the same row does (outputs, token ids, log probabilities, usage, reward).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutlog import participants as sdk
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.integrations.nemo_gym._gym import (
    Backend,
    GymProcesses,
    chunk_durable,
    gym_config,
    steps_row,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "nemo"
AGENT = "rolloutlog.integrations.nemo_gym:RolloutlogSimpleAgent"
POLICY = "rolloutlog.integrations.nemo_gym:RolloutlogVLLMModel"


def row(index: int, *, filler: int = 24, **params: Any) -> dict[str, Any]:
    """``example_multi_step``: two lookups in one tool round, an extraction, an answer (three
    model calls, turns 0-2); ``filler`` characters of text before each turn's action."""
    data = steps_row(index)
    data["responses_create_params"]["metadata"]["fake_tokens"] = str(filler)
    data["responses_create_params"].update(params)
    return data


ROWS = {
    # parked before its third model call: continues after both tool rounds
    "e1": row(1),
    # parked 48 streamed tokens into its second call (filler only): the cut is continued
    "e2": row(2, filler=80),
    # parked 32 tokens into its second call, inside the tool-call markup: regenerated
    "e3": row(3),
    # constrained decoding (tool_choice required): never streamed, never cut
    "e4": row(4, tool_choice="required"),
    # through the agent's /run (seed, loop, verify in one request), parked before its second call
    "e5": row(5),
}
#: where each rollout is parked: (turn, tokens generated)
HOLDS = {"e1": (2, 0), "e2": (1, 48), "e3": (1, 32), "e4": (1, 0), "e5": (1, 0)}
#: the rollouts that enter through ``/run``
RUN_ROUTE = {"e5"}


def marker(name: str) -> str:
    """What the backend's holds and call log know a rollout by (its prompt)."""
    return f"steps task {name[1:]}:"


class ScriptedBackend(Backend):
    async def hold_at(self, name: str, turn: int, after_tokens: int) -> None:
        body = {"match": marker(name), "turn": turn, "after_tokens": after_tokens}
        async with httpx.AsyncClient() as client:
            (await client.post(self.url + "/fake/holds", json=body)).raise_for_status()

    def turns(self, name: str) -> list[tuple[int, int, int]]:
        """``(turn, tokens continued, tokens generated)`` of a rollout's calls, in order."""
        return [
            (c["turn"], c["continued"], c.get("generated", -1))
            for c in self.calls()
            if marker(name) in c["prompt"]
        ]


class Environment:
    """The environment's part of a rollout over HTTP: ``episode.started``, then seed, the
    agent's loop and verify, each request under the rollout's capture key."""

    def __init__(self, gym: GymProcesses, participant: sdk.Environment) -> None:
        self.gym = gym
        self.participant = participant

    async def post(self, url: str, body: Any, key: str, restore_id: int | None = None) -> Any:
        headers = {"x-rolloutlog-capture-key": key}
        if restore_id is not None:
            headers["x-rolloutlog-restore-id"] = str(restore_id)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            reply = await client.post(url, json=body, headers=headers)
        reply.raise_for_status()
        return reply.json()

    async def seed(self, key: str, data: dict[str, Any]) -> None:
        await self.participant.start_episode(key, data)
        await self.post(f"{self.gym.url('steps')}/seed_session", data, key)

    async def loop(
        self, key: str, data: dict[str, Any], restore_id: int | None = None
    ) -> dict[str, Any]:
        url = f"{self.gym.url('steps_agent')}/v1/responses"
        response: dict[str, Any] = await self.post(
            url, data["responses_create_params"], key, restore_id
        )
        return response

    async def run(
        self, key: str, data: dict[str, Any], restore_id: int | None = None
    ) -> dict[str, Any]:
        """The agent's ``/run``: its own seed, loop and verify; returns the response."""
        if restore_id is None:
            await self.participant.start_episode(key, data)
        url = f"{self.gym.url('steps_agent')}/run"
        reply: dict[str, Any] = await self.post(url, data, key, restore_id)
        assert reply["reward"] == 1.0
        response: dict[str, Any] = reply["response"]
        return response

    async def rollout(
        self, key: str, data: dict[str, Any], restore_id: int | None = None
    ) -> dict[str, Any]:
        """The rollout's loop, through ``/run`` or (seeded before) ``/v1/responses``."""
        if key.split("-")[0] in RUN_ROUTE:
            return await self.run(key, data, restore_id)
        return await self.loop(key, data, restore_id)

    async def verify(self, key: str, data: dict[str, Any], response: dict[str, Any]) -> float:
        url = f"{self.gym.url('steps')}/verify"
        return float((await self.post(url, {**data, "response": response}, key))["reward"])

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.get(f"{self.gym.url('policy_model')}/rolloutlog/stats")
        stats: dict[str, Any] = reply.json()
        return stats


def outputs(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output without NeMo Gym's random item ids."""
    return [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[Service, ScriptedBackend, GymProcesses]]:
    service = Service(Deployment("embedded", tmp_path / "data"), tmp_path)
    backend = ScriptedBackend(tmp_path)
    config = gym_config(service.url, RUN, backend)
    for name in ("counter", "counter_agent"):  # this test needs the stateless Gym only
        del config[name]
    config["steps_agent"]["responses_api_agents"]["simple_agent"]["rolloutlog"] = {
        "server_class": AGENT
    }
    config["policy_model"]["responses_api_models"]["vllm_model"]["rolloutlog"] = {
        "server_class": POLICY,
        "stream": True,
        "chunk_tokens": 16,
    }
    gym = GymProcesses(tmp_path, config)
    try:
        await asyncio.gather(service.start(), backend.start())
        async with AsyncTrainerClient(service.url, token=TOKENS["admin"]) as trainer:
            await trainer.create_run(RUN, partitions=4)
        await gym.launch()
        yield service, backend, gym
    finally:
        gym.stop()
        backend.stop()
        service.stop()


async def test_rollouts_parked_mid_loop_continue_after_the_gym_dies(
    world: tuple[Service, ScriptedBackend, GymProcesses],
) -> None:
    service, backend, gym = world
    async with (
        AsyncTrainerClient(service.url, token=TOKENS["admin"], timeout_s=120) as trainer,
        sdk.HttpTransport(service.url, token=TOKENS["participant"]) as transport,
    ):
        await trainer.take_over(RUN)
        env = Environment(gym, sdk.Environment(transport, RUN, "env-0"))
        await env.participant.register()
        # Uninterrupted reference runs of the same rows (the model is a function of the prompt).
        reference = {}
        for name, data in ROWS.items():
            await env.seed(f"ref-{name}", data)
            reference[name] = await env.loop(f"ref-{name}", data)
            assert await env.verify(f"ref-{name}", data, reference[name]) == 1.0
        full = {name: [c[2] for c in backend.turns(name)] for name in ROWS}
        assert [len(calls) for calls in full.values()] == [3] * len(ROWS)

        for name, (turn, tokens) in HOLDS.items():
            await backend.hold_at(name, turn, tokens)
        for name, data in ROWS.items():
            if name not in RUN_ROUTE:
                await env.seed(name, data)
        loops = [asyncio.create_task(env.rollout(name, data)) for name, data in ROWS.items()]
        await backend.wait_parked(len(HOLDS))
        await chunk_durable(trainer, RUN, "e2", 32)  # 48 tokens durable: chunks at 0, 16, 32
        await chunk_durable(trainer, RUN, "e3", 16)
        checkpoint = await trainer.checkpoint(RUN)
        # nothing finishes an episode here (no collector): the reference rollouts are live
        # too, and the restore excludes them (their results are held)
        assert dict(checkpoint.counts) == {"continue": 10, "restart": 0, "finished": 0}

        gym.kill()
        await asyncio.gather(*loops, return_exceptions=True)
        await backend.release()
        restore = await trainer.restore(RUN, exclude=[f"ref-{name}" for name in ROWS])
        assert dict(restore.counts) == {"continue": 5, "restart": 0, "excluded": 5}
        projections = {
            name: await trainer.projection(RUN, name, restore=restore.restore_id) for name in ROWS
        }
        await gym.launch()
        continued = {
            name: await env.rollout(f"{name}-a1", data, restore.restore_id)
            for name, data in ROWS.items()
        }
        rewards = {
            name: await env.verify(f"{name}-a1", ROWS[name], continued[name]) for name in ROWS
        }
        stats = await env.stats()

    assert rewards == dict.fromkeys(ROWS, 1.0)
    for name in ROWS:
        assert outputs(continued[name]) == outputs(reference[name]), name
        assert continued[name]["usage"] == reference[name]["usage"], name

    # The restored rows: every call delivered before the checkpoint, none after.
    ledger = {name: [r["call_id"] for r in p["ledger"]] for name, p in projections.items()}
    assert ledger == {
        "e1": ["e1.c0", "e1.c1"],
        **{name: [f"{name}.c0"] for name in ("e2", "e3", "e4", "e5")},
    }
    # The second call's token ids are on its last output item: the first call's message and
    # two lookups, their two outputs, then the second call's message and extraction.
    second = {name: reference[name]["output"][6]["generation_token_ids"] for name in ROWS}
    cut = projections["e2"]["generation_cut"]
    assert (cut["call_id"], cut["terminal"], cut["token_ids"]) == (
        "e2.c1",
        False,
        second["e2"][:48],
    )
    cut = projections["e3"]["generation_cut"]
    assert (cut["call_id"], cut["token_ids"]) == ("e3.c1", second["e3"][:32])
    assert projections["e1"]["generation_cut"] is None
    assert projections["e4"]["generation_cut"] is None
    assert projections["e5"]["generation_cut"] is None

    # The backend's exact call log per rollout after its reference run: (turn, tokens
    # continued, tokens generated). No call delivered before the checkpoint is made again.
    assert {name: backend.turns(name)[3:] for name in ROWS} == {
        "e1": [(0, 0, full["e1"][0]), (1, 0, full["e1"][1]), (2, 0, 0), (2, 0, full["e1"][2])],
        "e2": [
            (0, 0, full["e2"][0]),
            (1, 0, 48),  # parked, then its stream was cut off by the kill
            (1, 48, full["e2"][1] - 48),  # continued from the cut: no token generated twice
            (2, 0, full["e2"][2]),
        ],
        "e3": [
            (0, 0, full["e3"][0]),
            (1, 0, 32),
            (1, 0, full["e3"][1]),  # the cut ends inside "<tool_call>": regenerated
            (2, 0, full["e3"][2]),
        ],
        "e4": [
            (0, 0, full["e4"][0]),
            (1, 0, full["e4"][1]),  # not streamed: generated whole, never delivered
            (1, 0, full["e4"][1]),
            (2, 0, full["e4"][2]),
        ],
        "e5": [(0, 0, full["e5"][0]), (1, 0, 0), (1, 0, full["e5"][1]), (2, 0, full["e5"][2])],
    }

    # Lineage: each replacement's first call resolves its parent among the restored rows.
    calls = {c["call_id"]: c for c in stats["calls"]}
    assert {call_id: c["parent_call_id"] for call_id, c in calls.items()} == {
        "e1-a1.c2": "e1.c1",
        "e2.c1": "e2.c0",  # the cut's call, continued under its own id
        "e2-a1.c2": "e2.c1",
        "e3-a1.c1": "e3.c0",  # regenerated under a new id
        "e3-a1.c2": "e3-a1.c1",
        "e4-a1.c1": "e4.c0",
        "e4-a1.c2": "e4-a1.c1",
        "e5-a1.c1": "e5.c0",  # resumed inside /run: the restore id rode the agent's own post
        "e5-a1.c2": "e5-a1.c1",
    }
    assert calls["e2.c1"]["continued"] == 48 and calls["e3-a1.c1"]["continued"] == 0
    assert calls["e4-a1.c1"]["constrained"] and calls["e4-a1.c1"]["chunks"] == 0
    assert stats["parents"] == {"restored": 5, "local": 4}
    assert stats["cuts_refused"] == 1  # e3's (reason unsafe_prefix)
