"""Each participant kind's events end to end through a checkpoint and a restore (in process)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rolloutlog.errors import AttemptFenced, InvalidRequest, ParticipantFenced, UnknownEpisode
from rolloutlog.log import task_digest as service_task_digest
from rolloutlog.participants import (
    Agent,
    Environment,
    Policy,
    Resources,
    fingerprint,
    ledger_digest,
    task_digest,
)
from tests.participants.conftest import RUN, World

TASK = {"prompt": "add 3", "b": [1, 2], "a": {"z": 1, "y": None}}


def test_task_digest_matches_the_restore_check() -> None:
    import orjson

    assert task_digest(TASK) == service_task_digest(orjson.dumps(TASK))


async def test_every_kind_continues_through_a_checkpoint_and_a_restore(world: World) -> None:
    transport = world.transport
    env = Environment(transport, RUN, "env-0")
    resources = Resources(transport, RUN, "res-0", mode="exported", verify="wait")
    agent = Agent(transport, RUN, "agent-0")
    policy = Policy(transport, RUN, "policy-0", policy_version=3, chunk_tokens=4)
    for participant in (env, resources, agent, policy):
        assert await participant.register() >= 1

    # attempt 0 of e1: seed, one agent turn with a tool round, a long call in flight
    episode = await env.start_episode("e1", TASK, deadline_s=600.0)
    await episode.step_started("seed")
    await resources.open_session("e1", "res-1", state={"counter": 0})
    session = await agent.open_session("e1", "ag-1")
    await episode.boundary("seed", {"resources": "res-1", "agent": "ag-1"})
    await episode.step_started("invoke_agent")
    assert await session.before_model_call({"turn": 0}) is not None
    assert await session.before_model_call({"turn": 0}) is None  # unchanged: lazy, no snapshot
    first = await policy.record_call(
        "e1", "c1", [5, 6, 7], fingerprint=fingerprint(["m1"]), context_digest="ctx-1"
    )
    assert first.digest == ledger_digest("", [5, 6, 7]) and first.cum_len == 3
    await resources.record_state("e1", "res-1", {"counter": 3})
    await session.after_tool_round({"turn": 1, "tools": ["add"]})
    assert (session.snapshots, session.skipped) == (2, 1)
    parent = policy.resolve_parent("e1", fingerprint(["m1"]))
    assert parent is not None and parent.call_id == "c1"
    generation = policy.generation("e1", "c2", parent_call_id="c1", request_digest="req-2")
    await generation.feed(range(100, 110))  # 10 tokens: two chunks of 4 durable, 2 pending
    assert (generation.chunks, generation.durable) == (2, 8)

    # e2: a restart-only session makes it start over
    other = Resources(transport, RUN, "res-1")
    await other.register()
    assert other.headers == {"x-ng-checkpoint-verify": "wait", "x-ng-checkpoint-restart": "1"}
    e2 = await env.start_episode("e2", {"prompt": "other"})
    await other.open_session("e2", "res-9")
    await e2.boundary("seed", {"resources": "res-9"})

    checkpoint = await world.trainer.checkpoint(RUN)
    assert checkpoint.counts == {"continue": 1, "restart": 1, "finished": 0}
    restore = await world.trainer.restore(RUN)

    with pytest.raises(UnknownEpisode) as refused:
        await world.restores.fetch(RUN, "e2", restore.restore_id)
    assert refused.value.details["action"] == "restart"

    projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
    assert projection["capture_key"] == "e1-a1"
    # environment: invoke_agent replays (the agent continues from its own snapshot)
    resumed = env.resume(projection, task=TASK)
    assert (resumed.stage, resumed.state) == (
        "invoke_agent",
        {"resources": "res-1", "agent": "ag-1"},
    )
    assert resumed.episode.capture_key == "e1-a1"
    with pytest.raises(InvalidRequest):
        env.resume(projection, task={"prompt": "another"})
    # resources: the state recorded before the last reply
    assert resources.restored_state(projection, "res-1") == {"counter": 3}
    assert resources.restored_sessions(projection) == {"res-1": {"counter": 3}}
    # agent: its last snapshot, lazily (an unchanged state writes nothing)
    restored, state, stage = agent.resume(projection, "ag-1")
    assert (state, stage) == ({"turn": 1, "tools": ["add"]}, "model_call")
    assert await restored.before_model_call(state) is None
    # policy: rows under the new capture key, the cut validated and continued
    bulk = [p async for p in world.restores.install(RUN, restore.restore_id, kind="policy")]
    assert [p["episode"] for p in bulk] == ["e1"]
    assert policy.install(bulk[0]) == 1
    assert policy.resolve_parent("e1-a1", fingerprint(["m1"])) == parent
    assert policy.validate_cut(projection, request_digest="req-other") is None
    cut = policy.validate_cut(projection, request_digest="req-2")
    assert cut is not None and cut.token_ids == tuple(range(100, 108))
    continued = policy.generation("e1-a1", "c2", request_digest="req-2", cut=cut)
    await continued.feed([108, 109, 110, 111])
    assert (continued.durable, continued.chunks) == (12, 1)  # the chunk started at 8
    await continued.complete()
    row = await policy.record_call(
        "e1-a1",
        "c2",
        continued.token_ids,
        fingerprint=fingerprint(["m1", "m2"]),
        context_digest="ctx-2",
        parent_call_id="c1",
    )
    assert (row.prev_len, row.cum_len) == (3, 15)
    assert row.digest == ledger_digest(first.digest, continued.token_ids)

    # the old attempt is fenced at once; the replacement finishes
    with pytest.raises(AttemptFenced):
        await episode.boundary("close_agent", {"late": True})
    await resumed.episode.boundary("invoke_agent", {"response": "3"})
    await resumed.episode.step_started("close_agent")
    await resumed.episode.boundary("close_agent", {"observations": 1})
    resumed.episode.set_verify_mode(resources.headers)
    assert resumed.episode.verify_mode == "wait"
    await resumed.episode.step_started("verify")
    await resumed.episode.boundary("verify", {"reward": 1.0})
    await resumed.episode.finish(1.0, {"answer": 3})

    again = await world.trainer.checkpoint(RUN)
    assert again.counts["finished"] == 1


async def test_a_reregistered_participant_fences_its_old_incarnation(world: World) -> None:
    old = Environment(world.transport, RUN, "env-0")
    await old.register()
    first = await old.start_episode("e1", TASK)
    new = Environment(world.transport, RUN, "env-0")
    assert await new.register() > (old.epoch or 0)
    await new.start_episode("e2", TASK)
    with pytest.raises(ParticipantFenced):
        await first.boundary("seed", {"zombie": True})


async def test_resume_without_a_boundary_starts_at_seed(world: World) -> None:
    env = Environment(world.transport, RUN, "env-0")
    await env.register()
    await env.start_episode("e1", TASK)
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
    resumed = env.resume(projection)
    assert (resumed.stage, resumed.state, resumed.task) == ("seed", None, TASK)


async def test_constrained_calls_are_never_chunked_and_each_skip_is_counted(world: World) -> None:
    policy = Policy(world.transport, RUN, "policy-0", chunk_tokens=2)
    await policy.register()
    generation = policy.generation("e1", "c1", request_digest="r", constrained=True)
    await generation.feed([1, 2, 3, 4, 5])
    await generation.complete()
    assert (generation.chunks, policy.chunks_skipped) == (0, 2)
    assert world.transport.stats.events == 0


async def test_a_call_delivered_after_the_last_boundary_is_a_terminal_cut(world: World) -> None:
    env = Environment(world.transport, RUN, "env-0")
    policy = Policy(world.transport, RUN, "policy-0", chunk_tokens=64)
    await env.register()
    await policy.register()
    episode = await env.start_episode("e1", TASK)
    await episode.step_started("invoke_agent")
    generation = policy.generation("e1", "c1", request_digest="r")
    await generation.feed([1, 2, 3])
    await generation.complete()  # shorter than a chunk: nothing written
    assert generation.chunks == 0
    done = await generation.deliver([1, 2, 3])
    await policy.record_call(
        "e1", "c1", [1, 2, 3], fingerprint=fingerprint(["m1"]), context_digest="ctx"
    )
    assert done is not None
    await done
    assert await generation.deliver([1, 2, 3]) is None  # its last chunk is written
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    projection = await world.restores.fetch(RUN, "e1", restore.restore_id)
    assert projection["ledger"] == []  # the row is in the tail: dropped
    cut = policy.validate_cut(projection, request_digest="r")
    assert cut is not None and (cut.call_id, cut.token_ids, cut.terminal) == ("c1", (1, 2, 3), True)
    served = policy.generation("e1-a1", "c1", request_digest="r", cut=cut)
    assert served.done and await served.deliver([1, 2, 3]) is None
    constrained = policy.generation("e1", "c2", request_digest="r", constrained=True)
    assert await constrained.deliver([4]) is None


async def test_the_export_hook_records_many_sessions_at_once(world: World) -> None:
    exported: list[list[tuple[str, str]]] = []

    async def export(sessions: Sequence[tuple[str, str]]) -> dict[tuple[str, str], object]:
        keys = list(sessions)
        exported.append(keys)
        return {key: {"sandbox": key[1]} for key in keys}

    env = Environment(world.transport, RUN, "env-0")
    resources = Resources(world.transport, RUN, "res-0", mode="exported", export_hook=export)
    stateless = Resources(world.transport, RUN, "res-1", mode="stateless")
    for participant in (env, resources, stateless):
        await participant.register()
    episodes = {}
    for i in range(3):
        episodes[f"e{i}"] = await env.start_episode(f"e{i}", {"i": i})
        await resources.open_session(f"e{i}", f"sb{i}")
        await stateless.open_session(f"e{i}", f"calc{i}")
        assert await stateless.record_state(f"e{i}", f"calc{i}", {"ignored": True}) is None
    await resources.export([(f"e{i}", f"sb{i}") for i in range(3)])
    assert len(exported) == 1
    for episode in episodes.values():
        await episode.boundary("seed", {})
    await world.trainer.checkpoint(RUN)
    restore = await world.trainer.restore(RUN)
    for i in range(3):
        projection = await world.restores.fetch(RUN, f"e{i}", restore.restore_id)
        assert resources.restored_state(projection, f"sb{i}") == {"sandbox": f"sb{i}"}
        assert projection["sessions"][f"calc{i}"]["mode"] == "stateless"


async def test_an_open_wait_step_holds_the_checkpoint_until_its_boundary(world: World) -> None:
    env = Environment(world.transport, RUN, "env-0")
    await env.register()
    episode = await env.start_episode("e1", TASK)
    await episode.boundary("seed", {"s": 1})
    await episode.boundary("invoke_agent", {"response": "r"})
    await episode.step_started("close_agent")  # wait mode: must not run twice
    pending = await world.trainer.checkpoint(RUN, wait=False)
    assert pending.status == "pending"
    await episode.boundary("close_agent", {"observations": [1]})
    done = await world.trainer.wait_for_checkpoint(RUN, pending.checkpoint_id, poll_s=0.01)
    assert done.status == "committed"
    restore = await world.trainer.restore(RUN)
    resumed = env.resume(await world.restores.fetch(RUN, "e1", restore.restore_id))
    assert (resumed.stage, resumed.state) == ("verify", {"observations": [1]})
