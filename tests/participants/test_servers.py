"""The transports against real backends: a real service process (HTTP) and a real Kafka broker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutlog.api import Settings, Tokens
from rolloutlog.errors import AttemptFenced
from rolloutlog.participants import (
    Agent,
    Environment,
    HttpTransport,
    KafkaTransport,
    Policy,
    Resources,
    Restores,
    RolloutContext,
    fingerprint,
)
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS, open_api
from tests.api.test_e2e import Server, running_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with running_server(tmp_path) as running:
        yield running


async def run_episodes(env: Environment, resources: Resources, count: int) -> None:
    async def one(i: int) -> None:
        episode = await env.start_episode(f"e{i}", {"i": i})
        await resources.open_session(f"e{i}", f"s{i}", state={"n": i})
        await episode.boundary("seed", {"session": f"s{i}"})

    await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.slow
async def test_the_http_transport_through_a_real_server(server: Server) -> None:
    trainer = AsyncTrainerClient(server.url, token=TOKENS["trainer"])
    async with trainer, HttpTransport(server.url, token=TOKENS["participant"]) as transport:
        await trainer.create_run("sdk", partitions=4)
        await trainer.take_over("sdk")
        env = Environment(transport, "sdk", "env-0")
        resources = Resources(transport, "sdk", "res-0", mode="exported")
        await env.register()
        await resources.register()
        await run_episodes(env, resources, 50)
        assert transport.stats.requests < transport.stats.events  # concurrent events coalesced
        checkpoint = await trainer.checkpoint("sdk")
        assert checkpoint.counts["continue"] == 50
        restore = await trainer.restore("sdk")
        async with Restores(server.url, token=TOKENS["participant"]) as restores:
            mine = [
                p
                async for p in restores.install(
                    "sdk", restore.restore_id, kind="resources", participant="res-0"
                )
            ]
        assert len(mine) == 50
        assert {resources.restored_state(p, f"s{p['episode'][1:]}")["n"] for p in mine} == set(
            range(50)
        )


@pytest.mark.kafka
async def test_the_kafka_transport_end_to_end(kafka_bootstrap: str, tmp_path: Path) -> None:
    log_url = f"kafka://{kafka_bootstrap}?topic_prefix=t{uuid.uuid4().hex[:10]}."
    settings = Settings(
        data_dir=tmp_path / "data", log_url=log_url, tokens=Tokens.from_mapping(TOKENS, "test")
    )
    async with open_api(settings) as api:
        trainer = AsyncTrainerClient(client=api.client, token=TOKENS["trainer"])
        await trainer.create_run("kr", partitions=4)
        await trainer.take_over("kr")
        async with KafkaTransport(
            log_url, client=api.client, token=TOKENS["participant"]
        ) as transport:
            env = Environment(transport, "kr", "env-0")
            resources = Resources(transport, "kr", "res-0", mode="exported")
            agent = Agent(transport, "kr", "agent-0")
            policy = Policy(transport, "kr", "policy-0", policy_version=1)
            for participant in (env, resources, agent, policy):
                await participant.register()
            await run_episodes(env, resources, 10)
            session = await agent.open_session("e0", "ag-0")
            await policy.record_call(
                "e0", "c1", [1, 2, 3], fingerprint=fingerprint(["a"]), context_digest="ctx"
            )
            await session.after_tool_round({"turn": 1})
            checkpoint = await trainer.checkpoint("kr")
            assert checkpoint.counts["continue"] == 10
            restore = await trainer.restore("kr")
            restores = Restores(client=api.client, token=TOKENS["participant"])
            projection = await restores.fetch("kr", "e0", restore.restore_id)
            assert projection["capture_key"] == "e0-a1"
            assert resources.restored_state(projection, "s0") == {"n": 0}
            assert agent.resume(projection, "ag-0")[1] == {"turn": 1}
            assert policy.install(projection) == 1
        # The direct path has no service in front to refuse a fenced attempt (the fold ignores
        # its events); through the service the same event is refused at once.
        async with HttpTransport(client=api.client, token=TOKENS["participant"]) as http:
            zombie = Environment(http, "kr", "env-1")
            await zombie.register()
            with pytest.raises(AttemptFenced):
                await zombie.emit(
                    "step.started",
                    RolloutContext("e1", 0),
                    {"owner": "environment", "stage": "seed", "mode": "replay"},
                )
