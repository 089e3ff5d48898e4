"""Cheap agent boundaries: an agent writes what changed since its last boundary,
the fold composes it, through a real checkpoint and restore; agents without hooks restart."""

from __future__ import annotations

import orjson
import pytest

from rolloutlog.log import compose_state, parse_capture_key, state_delta
from rolloutlog.participants import Agent, Environment
from tests.participants._agent_loop import run_loop
from tests.participants.conftest import RUN, World

#: Message sizes (bytes): a short LLM reply or tool output up to a long one.
SIZES = (300, 1700)


async def _start(world: World, episode: str) -> None:
    """The environment's side of the episode: started, and invoking the agent."""
    env = Environment(world.transport, RUN, f"env-{episode}")
    await env.register()
    started = await env.start_episode(episode, {"prompt": episode})
    await started.boundary("seed", {"agent": episode})


async def _log_bytes(world: World) -> int:
    log = world.api.service.log
    total = 0
    ends = await log.end_offsets(RUN)
    for partition, end in enumerate(ends):
        async for _, record in log.read_records(RUN, partition, 0, end):
            if b'"kind":"agent"' in record.split(b"\n", 1)[0]:
                total += len(record)
    return total


def test_a_delta_composes_sets_appends_and_removals() -> None:
    before = {"step": 1, "messages": [{"m": 1}], "gone": True, "usage": {"t": 1}}
    after = {"step": 2, "messages": [{"m": 1}, {"m": 2}], "usage": {"t": 5}, "new": []}
    delta = state_delta(before, after)
    assert delta == {
        "set": {"step": 2, "usage": {"t": 5}, "new": []},
        "append": {"messages": [{"m": 2}]},
        "unset": ["gone"],
    }
    assert (
        orjson.loads(compose_state(orjson.dumps(before), [orjson.dumps({"$delta": delta})]))
        == after
    )
    assert state_delta(after, after) == {}
    # a list that changed other than by growing is set whole
    assert state_delta({"a": [1, 2]}, {"a": [9, 2, 3]}) == {"set": {"a": [9, 2, 3]}}


async def test_agent_deltas_through_two_checkpoints_and_restores(world: World) -> None:
    agent = Agent(world.transport, RUN, "agent-0")
    await agent.register()
    await _start(world, "d1")
    session = await agent.open_session("d1", "ag-d1")
    state, message_bytes = await run_loop(session, 40, SIZES)
    # the initial state, then one delta per turn (unchanged before each later model call)
    assert (session.snapshots, session.skipped) == (41, 39)

    # The log holds about the messages, not the square of the history.
    log_bytes = await _log_bytes(world)
    assert log_bytes <= 1.5 * message_bytes, (log_bytes, message_bytes)

    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "d1", restore.restore_id)
    resumed, restored, stage = agent.resume(projection, "ag-d1")
    assert (restored, stage) == (state, "model_call")
    assert await resumed.before_model_call(restored) is None  # nothing changed since

    # The replacement attempt goes on with deltas onto the restored state.
    assert parse_capture_key(projection["capture_key"]) == ("d1", 1)
    more, _ = await run_loop(resumed, 5, SIZES, seed=8)
    final = {**more, "messages": [*restored["messages"], *more["messages"]]}
    await resumed.after_tool_round(final)
    await world.trainer.checkpoint(RUN)
    second = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "d1", second.restore_id)
    assert agent.resume(projection, "ag-d1")[1] == final


async def test_whole_states_grow_with_the_square_of_the_history(world: World) -> None:
    agent = Agent(world.transport, RUN, "agent-w", deltas=False)
    await agent.register()
    await _start(world, "w1")
    session = await agent.open_session("w1", "ag-w1")
    _, message_bytes = await run_loop(session, 40, SIZES)
    assert await _log_bytes(world) > 10 * message_bytes


async def test_an_agent_without_hooks_is_restart_only(world: World) -> None:
    agent = Agent(world.transport, RUN, "agent-nohooks", hooks=False)
    await agent.register()
    session = await agent.open_session("h1", "ag-h1")
    await _start(world, "h1")  # the session is open at a committed boundary
    await run_loop(session, 3, SIZES)
    assert session.snapshots == 0
    checkpoint = await world.trainer.checkpoint(RUN)
    assert checkpoint.counts["restart"] == 1
    manifest = await world.api.call(
        "GET", f"/v1/runs/{RUN}/checkpoints/{checkpoint.checkpoint_id}/manifest", "analyst", 200
    )
    (entry,) = manifest.json()["episodes"]
    assert entry["reason"] == (
        "restart-only session ag-h1 of agent agent-nohooks (an agent without session hooks) "
        "open at the cut"
    )


@pytest.mark.parametrize("deltas", [True, False])
async def test_a_non_object_state_is_written_whole(world: World, deltas: bool) -> None:
    agent = Agent(world.transport, RUN, f"agent-list-{deltas}", deltas=deltas)
    await agent.register()
    await _start(world, "l1")
    session = await agent.open_session("l1", "ag-l1")
    await session.before_model_call([1, 2])
    await session.after_tool_round([1, 2, 3])
    assert await session.before_model_call([1, 2, 3]) is None
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "l1", restore.restore_id)
    assert agent.resume(projection, "ag-l1")[1] == [1, 2, 3]
