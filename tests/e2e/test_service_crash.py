"""Scenario 11: the service itself SIGKILLed during a checkpoint and during a restore leaves the
catalog whole (a checkpoint is whole or absent; no half restore) and the next attempt succeeds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rolloutlog.errors import UnknownCheckpoint
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Puppet, Service, catalog_writes_held
from tests.e2e.conftest import RUN

pytestmark = pytest.mark.slow

EPISODES = ("e0", "e1", "e2", "e3")


async def environment(puppets: Callable[[str], Puppet], deployment: Deployment) -> Puppet:
    """An environment process with EPISODES seeded and past ``invoke_agent`` (state: the turn)."""
    env = puppets("env")
    await env.open(deployment)
    assert await env.participant("env", "environment", "env-0") == 1
    for i, episode in enumerate(EPISODES):
        await env.call("env", "start_episode", episode, {"task": i}, as_=episode)
        await env.call(episode, "boundary", "seed", {"turn": 0})
        await env.call(episode, "boundary", "invoke_agent", {"turn": i + 1})
    return env


async def get(service: Service, path: str) -> Any:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(
            f"{service.url}/v1/runs/{RUN}{path}",
            headers={"Authorization": f"Bearer {TOKENS['admin']}"},
        )
    return response


async def restored_boundaries(
    trainer: AsyncTrainerClient, restore_id: int
) -> dict[str, tuple[str, Any]]:
    found = {}
    async for projection in trainer.projections(RUN, restore_id, kind="environment"):
        boundary = projection["boundaries"]["environment"]
        found[projection["capture_key"]] = (boundary["stage"], boundary["state"])
    return found


async def test_killed_while_a_checkpoint_is_pending(
    deployment: Deployment,
    service: Service,
    trainer: AsyncTrainerClient,
    puppets: Callable[[str], Puppet],
) -> None:
    env = await environment(puppets, deployment)
    first = await trainer.checkpoint(RUN)
    assert (first.status, dict(first.counts)) == (
        "committed",
        {"continue": 4, "restart": 0, "finished": 0},
    )
    # e0 opens its close_agent wait step: the next checkpoint stays pending until its boundary.
    await env.call("e0", "step_started", "close_agent")
    pending = await trainer.checkpoint(RUN, wait=False, deadline_s=120)
    assert pending.status == "pending"
    assert (await trainer.get_checkpoint(RUN, pending.checkpoint_id)).status == "pending"

    service.kill()
    await service.start()

    # Absent, not half there: aborted by the restart, no manifest; the latest is still the first.
    dead = await trainer.get_checkpoint(RUN, pending.checkpoint_id)
    assert dead.status == "aborted"
    with pytest.raises(UnknownCheckpoint, match="aborted"):
        [e async for e in trainer.manifest(RUN, pending.checkpoint_id)]
    assert (await trainer.get_checkpoint(RUN, "latest")).checkpoint_id == first.checkpoint_id
    committed = await trainer.list_checkpoints(RUN, status="committed")
    assert [c.checkpoint_id for c in committed] == [first.checkpoint_id]

    # The participant never paused: its wait step closes, and the next checkpoint sees it.
    await env.call("e0", "boundary", "close_agent", {"observations": "o0"})
    await env.call("e1", "boundary", "close_agent", {"observations": "o1"})
    again = await trainer.checkpoint(RUN)
    assert again.checkpoint_id > pending.checkpoint_id
    assert (again.status, dict(again.counts)) == (
        "committed",
        {"continue": 4, "restart": 0, "finished": 0},
    )
    restore = await trainer.restore(RUN)
    assert restore.checkpoint_id == again.checkpoint_id
    assert await restored_boundaries(trainer, restore.restore_id) == {
        "e0-a1": ("close_agent", {"observations": "o0"}),
        "e1-a1": ("close_agent", {"observations": "o1"}),
        "e2-a1": ("invoke_agent", {"turn": 3}),
        "e3-a1": ("invoke_agent", {"turn": 4}),
    }


# A restore killed after its attempt.started records and before its catalog commit leaves those
# records in the log under its reserved restore id, which no later restore gets: where the retry's
# plan differs (here e3, excluded by the dead restore with cut 0, is continued by the retry), the
# dead plan's records must change nothing.
@pytest.mark.parametrize(
    "retry_exclude",
    [["e3"], []],
    ids=["same-plan", "changed-plan"],
)
async def test_killed_between_a_restores_attempts_and_its_commit(
    deployment: Deployment,
    service: Service,
    trainer: AsyncTrainerClient,
    puppets: Callable[[str], Puppet],
    retry_exclude: list[str],
) -> None:
    env = await environment(puppets, deployment)
    checkpoint = await trainer.checkpoint(RUN)
    assert checkpoint.counts["continue"] == 4
    before = (await trainer.stats(RUN))["events"]["log_records"]

    async with catalog_writes_held(deployment, "restores", RUN) as hold:
        restoring = asyncio.create_task(trainer.restore(RUN, exclude=["e3"]))
        # Its four attempt.started records are in the log; its catalog commit waits.
        await hold.wait_until_blocked(service, RUN, before + len(EPISODES))
        assert not restoring.done()
        service.kill()
    with pytest.raises(httpx.TransportError):
        await restoring

    await service.start()
    # No half restore: none is listed, every episode is still at attempt 0 ...
    listed = await get(service, "/restores")
    assert listed.json() == {"restores": []}
    keys = sorted([e["capture_key"] async for e in trainer.episodes(RUN)])
    assert keys == list(EPISODES)
    # ... and attempt 0 still appends (nothing fenced it), excluded e3 included.
    await env.call("e3", "boundary", "close_agent", {"observations": "late"})

    # The next restore succeeds, from the same checkpoint, and is the only one of the run.
    restore = await trainer.restore(RUN, exclude=retry_exclude)
    assert restore.checkpoint_id == checkpoint.checkpoint_id
    listed = await get(service, "/restores")
    assert [r["restore_id"] for r in listed.json()["restores"]] == [restore.restore_id]
    episodes = {
        e.episode: (e.previous_attempt, e.attempt, e.action)
        async for e in trainer.restore_episodes(RUN, restore.restore_id)
    }
    assert episodes == {
        e: (0, 1, "excluded" if e in retry_exclude else "continue") for e in EPISODES
    }
    continued = [e for e in EPISODES if e not in retry_exclude]
    assert await restored_boundaries(trainer, restore.restore_id) == {
        f"{e}-a1": ("invoke_agent", {"turn": EPISODES.index(e) + 1}) for e in continued
    }

    # The next checkpoint and restore carry the continued episodes whole: the dead restore's
    # records change nothing.
    env.kill()
    second = await trainer.checkpoint(RUN)
    assert dict(second.counts) == {"continue": len(continued), "restart": 0, "finished": 0}
    again = await trainer.restore(RUN)
    assert dict(again.counts) == {"continue": len(continued), "restart": 0, "excluded": 0}
    assert await restored_boundaries(trainer, again.restore_id) == {
        f"{e}-a2": ("invoke_agent", {"turn": EPISODES.index(e) + 1}) for e in continued
    }
