"""Participants ride through a service restart: the service SIGKILLed while a participant appends
and started again ~5 s later; every event is acknowledged once, in order, and folded once. And
the demo with two policy workers and the service killed mid-run, on both deployments."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import httpx
import pytest

from rolloutlog.log import Position
from rolloutlog.participants import Environment, HttpTransport, RolloutContext
from rolloutlog.participants._participant import opaque
from rolloutlog.participants.sim.demo import run_demo
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service
from tests.e2e.conftest import RUN
from tests.participants.test_sim import check

pytestmark = pytest.mark.slow

EPISODES = ("e0", "e1", "e2")


async def timeline(service: Service, episode: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(
            f"{service.url}/v1/runs/{RUN}/episodes/{episode}",
            params={"limit": 10_000},
            headers={"Authorization": f"Bearer {TOKENS['admin']}"},
        )
    response.raise_for_status()
    events: list[dict[str, Any]] = response.json()["events"]
    return events


async def test_appends_ride_through_a_service_killed_and_restarted(
    service: Service, trainer: AsyncTrainerClient
) -> None:
    failures: list[Any] = []
    transport = HttpTransport(
        service.url,
        token=TOKENS["participant"],
        deadline_s=60.0,
        on_failure=lambda run, event, error: failures.append((event["seq"], error)),
    )
    async with transport:
        env = Environment(transport, RUN, "env-0")
        await env.register()
        for episode in EPISODES:
            await env.start_episode(episode, {"task": episode})
        sent: dict[str, list[tuple[int, asyncio.Future[Position]]]] = {e: [] for e in EPISODES}
        stop = asyncio.Event()

        async def append() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                for episode in EPISODES:
                    data = {
                        "owner": "environment",
                        "stage": "invoke_agent",
                        "next": "close_agent",
                        "state": opaque({"i": i}),
                    }
                    context = RolloutContext(episode)
                    future = await env.emit_nowait("step.boundary", context, data, step=i)
                    sent[episode].append((i, future))
                await asyncio.sleep(0.02)

        appender = asyncio.create_task(append())
        await asyncio.sleep(1.0)
        service.kill()
        killed = time.monotonic()
        await asyncio.sleep(5.0)
        await service.start()
        down_s = time.monotonic() - killed
        await asyncio.sleep(1.0)
        stop.set()
        await appender
        for episode in EPISODES:
            positions = [await future for _, future in sent[episode]]
            offsets = [p.offset for p in positions]
            assert offsets == sorted(set(offsets)), episode  # acknowledged once each, in order
        assert failures == [] and transport.stats.retries > 0 and down_s >= 5.0

    # In the log and the fold once each, in order: duplicates (a request whose reply died with
    # the service, sent again) carry the same seq and are dropped by the fold.
    for episode in EPISODES:
        events = [e for e in await timeline(service, episode) if e["type"] == "step.boundary"]
        seqs = [e["seq"] for e in events]
        firsts = list(dict.fromkeys(seqs))
        assert firsts == sorted(firsts) and len(firsts) == len(sent[episode])
    checkpoint = await trainer.checkpoint(RUN)
    assert dict(checkpoint.counts)["continue"] == len(EPISODES)
    for episode in EPISODES:
        projection = await trainer.projection(RUN, episode, checkpoint=checkpoint.checkpoint_id)
        last = sent[episode][-1][0]
        assert projection["boundaries"]["environment"]["state"] == {"i": last}


async def test_the_demo_with_two_policy_workers_and_the_service_killed_mid_run(
    deployment: Deployment,
) -> None:
    """``make demo DEMO_ARGS="--policy-workers 2 --kill-service"`` at a small scale: every
    rollout finishes with its reward although the service died with rollouts in flight."""
    result = await run_demo(
        24,
        concurrency=8,
        data_dir=deployment.data_dir / "demo",
        log_url=deployment.log_url,
        catalog_url=deployment.catalog_url,
        participant_transport=deployment.transport,
        policy_workers=2,
        kill_service=True,
        service_down_s=4.0,
        out=io.StringIO(),
    )
    check(result, 24)
    assert result.timings["service_down_s"] >= 4.0
    policy = result.stats["policy"]
    assert len(policy["workers"]) == 2 and policy["parents"]["other_worker"] > 0
