"""Export-on-checkpoint sessions: the checkpoint asks, the resources server
exports, the checkpoint waits for the export like an open wait step, bounded by its deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest

from rolloutlog.errors import UnknownEpisode
from rolloutlog.participants import Environment, EnvironmentEpisode, Resources, RolloutContext
from rolloutlog.participants._sessions import SessionKey
from tests.participants.conftest import RUN, World

TASK = {"prompt": "sandbox"}


class Sandbox:
    """Outside state: per capture key a counter; exports give a snapshot reference."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.snapshots: dict[str, int] = {}
        self.leave_out: set[str] = set()

    async def export(self, sessions: Sequence[SessionKey]) -> Mapping[SessionKey, Any]:
        found = {}
        for key, sid in sessions:
            if key in self.leave_out:
                continue  # dropped
            ref = f"snap-{key}-{len(self.snapshots)}"
            self.snapshots[ref] = self.counters[key]
            found[(key, sid)] = {"snapshot": ref}
        return found


@contextlib.asynccontextmanager
async def serving(resources: Resources, world: World) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(resources.serve_exports(world.restores, poll_s=2.0))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def setup(world: World, episodes: Sequence[str]) -> tuple[Resources, Sandbox, Environment]:
    sandbox = Sandbox()
    resources = Resources(
        world.transport, RUN, "sandbox-0", mode="checkpoint", export_hook=sandbox.export
    )
    env = Environment(world.transport, RUN, "env-0")
    await resources.register()
    await env.register()
    for episode in episodes:
        started = await env.start_episode(episode, TASK)
        await resources.open_session(episode, f"sb:{episode}")
        for _ in range(3):  # three tool calls: the counter changes, a change mark each
            sandbox.counters[episode] = sandbox.counters.get(episode, 0) + 1
            await resources.record_state(episode, f"sb:{episode}", None)
        await started.boundary("invoke_agent", {"session": f"sb:{episode}"})
    return resources, sandbox, env


async def test_the_checkpoint_waits_for_the_export_and_the_restore_hands_it_back(
    world: World,
) -> None:
    resources, sandbox, _ = await setup(world, ["e1", "e2"])
    async with serving(resources, world):
        checkpoint = await world.trainer.checkpoint(RUN, deadline_s=20)
    assert checkpoint.counts == {"continue": 2, "restart": 0, "finished": 0}
    assert resources.exports == 2
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
    state = resources.restored_state(projection, "sb:e1")
    assert sandbox.snapshots[state["snapshot"]] == 3
    assert projection["sessions"]["sb:e1"]["mode"] == "checkpoint"


async def test_sessions_not_exported_restart_at_the_deadline_with_the_reason(
    world: World,
) -> None:
    resources, sandbox, _ = await setup(world, ["e1", "e2"])
    sandbox.leave_out.add("e2")  # the batch hook leaves it out: dropped, not an error
    async with serving(resources, world):
        checkpoint = await world.trainer.checkpoint(RUN, deadline_s=1.0)
    assert checkpoint.counts == {"continue": 1, "restart": 1, "finished": 0}
    restore = await world.trainer.restore(RUN)
    plan = {e.episode: e async for e in world.trainer.restore_episodes(RUN, restore.restore_id)}
    assert plan["e2"].reason == "session sb:e2 not exported by checkpoint 1's deadline"
    with pytest.raises(UnknownEpisode):
        await world.restores.fetch(RUN, "e2", restore.restore_id)


async def test_an_export_with_uncommitted_changes_waits_for_the_next_boundary(
    world: World,
) -> None:
    resources, sandbox, env = await setup(world, ["e1"])
    # a tool call after the last boundary: its change mark is in the tail at the export
    sandbox.counters["e1"] += 1
    await resources.record_state("e1", "sb:e1", None)
    pending = await world.trainer.checkpoint(RUN, wait=False, deadline_s=20)
    assert pending.status == "pending"
    asked = await world.restores.pending_exports(RUN, "sandbox-0", wait_s=5)
    assert asked is not None and asked["checkpoint_id"] == pending.checkpoint_id
    assert [s["session_id"] for s in asked["sessions"]] == ["sb:e1"]
    assert await world.restores.pending_exports(RUN, "someone-else", wait_s=0) is None
    await resources.export([("e1", "sb:e1")], checkpoint_id=pending.checkpoint_id)
    await asyncio.sleep(0.3)
    assert (await world.trainer.get_checkpoint(RUN, pending.checkpoint_id)).status == "pending"
    # the agent's boundary after that tool round commits the change: the export matches now
    episode = await env.start_episode("e1-late", TASK)  # another episode's events do not help
    await episode.boundary("seed", {})
    assert (await world.trainer.get_checkpoint(RUN, pending.checkpoint_id)).status == "pending"
    e1 = EnvironmentEpisode(env, RolloutContext("e1"), step=1)
    await e1.boundary("close_agent", {"session": "sb:e1"})
    done = await world.trainer.wait_for_checkpoint(RUN, pending.checkpoint_id, timeout_s=10)
    assert done.status == "committed" and done.counts["continue"] >= 1
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
    assert projection["boundaries"]["environment"]["stage"] == "close_agent"
    state = resources.restored_state(projection, "sb:e1")
    assert sandbox.snapshots[state["snapshot"]] == 4


async def test_a_change_after_the_export_makes_it_stale(world: World) -> None:
    resources, sandbox, _ = await setup(world, ["e1"])
    sandbox.counters["e1"] += 1
    await resources.record_state("e1", "sb:e1", None)
    pending = await world.trainer.checkpoint(RUN, wait=False, deadline_s=1.0)
    await resources.export([("e1", "sb:e1")], checkpoint_id=pending.checkpoint_id)
    sandbox.counters["e1"] += 1  # changed again before a boundary committed the first change
    await resources.record_state("e1", "sb:e1", None)
    done = await world.trainer.wait_for_checkpoint(RUN, pending.checkpoint_id, timeout_s=10)
    assert done.counts == {"continue": 0, "restart": 1, "finished": 0}


async def test_an_episode_that_finishes_needs_no_export(world: World) -> None:
    """A session closed and its episode finished after the markers: the checkpoint reports it
    finished at once instead of waiting for an export that cannot come."""
    resources, _, env = await setup(world, ["e1"])
    pending = await world.trainer.checkpoint(RUN, wait=False, deadline_s=20)
    assert pending.status == "pending"
    await resources.end_session("e1", "sb:e1")
    await EnvironmentEpisode(env, RolloutContext("e1"), step=1).finish(1.0, {"answer": 3})
    done = await world.trainer.wait_for_checkpoint(RUN, pending.checkpoint_id, timeout_s=5)
    assert done.counts == {"continue": 0, "restart": 0, "finished": 1}
