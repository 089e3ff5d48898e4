"""Scenarios 1-9 on the simulated Gym: real participant processes parked at hold points, a
checkpoint, SIGKILL of every participant process group, a restore, and replacement processes
finishing the episodes; each scenario asserts the exact model calls and rewards.

Tasks are pure functions (``rolloutlog.participants.sim``): ``rounds`` tool rounds, so
``rounds + 1`` model calls whose tokens depend only on (episode, call index); the counter server's
reward is 1.0 only if the answer is right and its counter equals ``rounds``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutlog.participants.sim import Gym, expected_answer, make_task, sim_tokens
from rolloutlog.trainer import AsyncTrainerClient
from tests.e2e._gym import Episodes, calls_of, runs_of

pytestmark = pytest.mark.slow

ALL_STAGES = ["seed", "invoke_agent", "close_agent", "verify", "return"]


async def plan_of(trainer: AsyncTrainerClient, run: str, restore_id: int) -> dict[str, Any]:
    return {
        e.episode: (e.previous_attempt, e.attempt, e.action)
        async for e in trainer.restore_episodes(run, restore_id)
    }


async def manifest_of(trainer: AsyncTrainerClient, run: str, checkpoint_id: int) -> dict[str, str]:
    return {e["episode"]: e["action"] async for e in trainer.manifest(run, checkpoint_id)}


def right(reply: dict[str, Any], task: dict[str, Any]) -> bool:
    return reply["reward"] == 1.0 and reply["response"]["answer"] == expected_answer(task)


@pytest.mark.parametrize("policy_workers", [2])
async def test_one_crash_with_every_kind_of_episode_in_flight(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """1 continue from the last boundary, 2 the counter's restored state gives the right reward,
    3 token lineage and an undelivered call, 4 an in-flight generation cut and continued (a
    constrained one regenerated, a completed undelivered one a terminal cut), 6 verify in flight replayed or waited for, 7 episodes
    finishing before and during the checkpoint, 9 a restart-only session starting over.

    The policy runs two worker processes and the agent alternates between them, so lineage
    and cuts resolve across workers (a parent recorded by one, a cut claimed by one)."""
    run, trainer = gym.run, gym_trainer
    tasks = {
        "cont": make_task("cont"),
        "undeliv": make_task("undeliv", tokens=8),  # short calls: no chunks, so no cut
        "cut": make_task("cut", rounds=1, tokens=96),
        "constr": make_task("constr", rounds=1, tokens=96, constrained=(0,)),
        "term": make_task("term", rounds=1),
        "vrep": make_task("vrep"),
        "vwait": make_task("vwait", resources="verifier"),
        "finbefore": make_task("finbefore"),
        "finduring": make_task("finduring"),
        "restart": make_task("restart", resources="restart"),
    }
    # 7: one episode finishes before the checkpoint.
    episodes.start(tasks["finbefore"])
    assert right(await episodes.reply("finbefore"), tasks["finbefore"])

    holds = [
        ("agent", "after_tool_round", "cont"),
        ("agent", "after_tool_round", "undeliv"),
        ("policy", "mid_generation", "cut"),
        ("policy", "mid_generation", "constr"),
        ("policy", "before_deliver", "term"),
        ("counter", "in_verify", "vrep"),
        ("verifier", "in_verify", "vwait"),
        ("environment", "before_finish", "finduring"),
        ("agent", "after_tool_round", "restart"),
    ]
    for name, point, key in holds:
        await gym.hold(name, point, key, after_tokens=48 if point == "mid_generation" else 0)
    for key in {key for _, _, key in holds}:
        episodes.start(tasks[key])
    parked = {key: await episodes.held(name, point, key) for name, point, key in holds}
    assert parked["cont"]["round"] == 1
    assert (parked["cut"]["call_id"], parked["constr"]["call_id"]) == ("cut.c0", "constr.c0")
    # 3: undeliv's second call is generated and its ledger row durable, but never delivered.
    await gym.hold("policy", "before_deliver", "undeliv")
    await gym.release("agent", "after_tool_round", "undeliv")
    assert (await episodes.held("policy", "before_deliver", "undeliv"))["call_id"] == "undeliv.c1"

    # 6: vwait's verify is a wait step: the checkpoint stays pending until its boundary.
    pending = await trainer.checkpoint(run, wait=False, deadline_s=120)
    assert pending.status == "pending"
    # 7: finduring finishes while the checkpoint is pending; the trainer gets its result.
    await gym.release("environment", "before_finish", "finduring")
    assert right(await episodes.reply("finduring"), tasks["finduring"])
    assert (await trainer.get_checkpoint(run, pending.checkpoint_id)).status == "pending"
    await gym.hold("environment", "before:return", "vwait")
    await gym.release("verifier", "in_verify", "vwait")
    await episodes.held("environment", "before:return", "vwait")
    checkpoint = await trainer.wait_for_checkpoint(run, pending.checkpoint_id, timeout_s=60)
    assert checkpoint.status == "committed"
    manifest = await manifest_of(trainer, run, checkpoint.checkpoint_id)
    assert manifest == {
        "finbefore": "finished",
        "finduring": "continue",  # its finish came after the marker: the cut is before it
        "restart": "restart",
        **{
            key: "continue" for key in ("cont", "undeliv", "cut", "constr", "term", "vrep", "vwait")
        },
    }

    gym.kill_participants()
    await episodes.cut_off(list(episodes.running))
    restore = await trainer.restore(run, exclude=["finduring"])
    continued = ["cont", "undeliv", "cut", "constr", "term", "vrep", "vwait"]
    assert await plan_of(trainer, run, restore.restore_id) == {
        "finduring": (0, 1, "excluded"),
        "restart": (0, 1, "restart"),
        **{key: (0, 1, "continue") for key in continued},
    }
    # 3: the undelivered call's row is not in the restored ledger; 4: the cut holds the durable
    # prefix of the in-flight call; a constrained call is never cut.
    undeliv = await trainer.projection(run, "undeliv", restore=restore.restore_id)
    assert [row["call_id"] for row in undeliv["ledger"]] == ["undeliv.c0"]
    assert undeliv["generation_cut"] is None
    cut = (await trainer.projection(run, "cut", restore=restore.restore_id))["generation_cut"]
    assert (cut["call_id"], cut["terminal"]) == ("cut.c0", False)
    assert cut["token_ids"] == sim_tokens("cut", 0, 96)[:48]
    constr = await trainer.projection(run, "constr", restore=restore.restore_id)
    assert constr["generation_cut"] is None
    # A long call completed but never delivered: a terminal cut (its ledger row is in the tail).
    term = await trainer.projection(run, "term", restore=restore.restore_id)
    assert term["ledger"] == []
    assert (term["generation_cut"]["call_id"], term["generation_cut"]["terminal"]) == (
        "term.c0",
        True,
    )
    assert term["generation_cut"]["token_ids"] == sim_tokens("term", 0, 48)

    await gym.start_participants(restore.restore_id)
    for key in continued:
        episodes.start(tasks[key], f"{key}-a1", "continue", restore.restore_id)
    episodes.start(tasks["restart"], "restart-a1", "restart", restore.restore_id)
    replies = {key: await episodes.reply(f"{key}-a1") for key in [*continued, "restart"]}
    wrong = {key: reply["reward"] for key, reply in replies.items() if not right(reply, tasks[key])}
    assert wrong == {}

    policy, agent = await gym.stats("policy"), await gym.stats("agent")
    counter, verifier = await gym.stats("counter"), await gym.stats("verifier")
    environment = await gym.stats("environment")
    # 1: cont continues at invoke_agent, its agent from the round-1 snapshot; 2: with the
    # counter restored at 1. 3: the first call's parent is the restored row.
    assert replies["cont"]["stages"] == ALL_STAGES[1:]
    assert [r["resumed"] for r in runs_of(agent, "cont-a1")] == [1]
    assert counter["restored"]["cont-a1"] == 1
    assert calls_of(policy, "cont-a1") == [
        ("cont-a1.c1", "cont.c0", 0, 48),
        ("cont-a1.c2", "cont-a1.c1", 0, 48),
    ]
    assert policy["installed"]["cont-a1"] == 1
    # 3: the undelivered call is made again, its parent resolved from the restored rows.
    assert calls_of(policy, "undeliv-a1") == [
        ("undeliv-a1.c1", "undeliv.c0", 0, 8),
        ("undeliv-a1.c2", "undeliv-a1.c1", 0, 8),
    ]
    # 4: the cut call continues under its call id from 48 durable tokens; the constrained one
    # regenerates from the start.
    assert calls_of(policy, "cut-a1") == [("cut.c0", None, 48, 48), ("cut-a1.c1", "cut.c0", 0, 96)]
    assert all(c["prefix_ok"] for c in policy["calls"])
    assert calls_of(policy, "term-a1") == [
        ("term.c0", None, 48, 0),
        ("term-a1.c1", "term.c0", 0, 48),
    ]
    assert calls_of(policy, "constr-a1") == [
        ("constr-a1.c0", None, 0, 96),
        ("constr-a1.c1", "constr-a1.c0", 0, 96),
    ]
    # 6: a replay verify runs again; a wait verify finished before the cut and is not redone.
    assert (replies["vrep"]["resumed_stage"], replies["vrep"]["stages"]) == (
        "verify",
        ["verify", "return"],
    )
    assert "vrep-a1" in counter["verifies"]
    assert (replies["vwait"]["resumed_stage"], replies["vwait"]["stages"]) == ("return", ["return"])
    assert verifier["verifies"] == []
    # 9: the restart-only episode starts over from seed with fresh calls.
    assert (replies["restart"]["resumed_stage"], replies["restart"]["stages"]) == (
        None,
        ALL_STAGES,
    )
    assert calls_of(policy, "restart-a1") == [
        ("restart-a1.c0", None, 0, 48),
        ("restart-a1.c1", "restart-a1.c0", 0, 48),
        ("restart-a1.c2", "restart-a1.c1", 0, 48),
    ]
    # Two workers: calls alternate, so every parent recorded in this attempt was recorded by
    # the other worker (cont, undeliv, cut, term, constr once each, restart twice).
    crossed = [
        c["call_id"] for c in policy["calls"] if c["parent_worker"] not in (None, c["worker"])
    ]
    assert len(crossed) == 7 and policy["parents"]["other_worker"] == 7, crossed
    assert policy["cuts_refused"] == 0  # each restored cut continued by one call, on one worker
    # 7: neither finished episode is redone by anyone.
    keys = {run["capture_key"] for run in environment["runs"]}
    assert keys == {f"{key}-a1" for key in [*continued, "restart"]}
    assert {c["capture_key"] for c in policy["calls"]} == keys - {"vrep-a1", "vwait-a1"}

    after = await trainer.checkpoint(run)
    assert dict(after.counts) == {"continue": 0, "restart": 0, "finished": 8}


async def test_the_counter_reward_needs_the_restored_state(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """2, negative control: the same crash with a counter server that skips the resources
    restore gets the wrong reward (the answer is still right: only the counter is wrong)."""
    run, trainer = gym.run, gym_trainer
    task = make_task("neg")
    await gym.hold("agent", "after_tool_round", "neg")
    episodes.start(task)
    assert (await episodes.held("agent", "after_tool_round", "neg"))["round"] == 1
    checkpoint = await trainer.checkpoint(run)
    assert dict(checkpoint.counts) == {"continue": 1, "restart": 0, "finished": 0}
    gym.kill_participants()
    await episodes.cut_off(["neg"])
    restore = await trainer.restore(run)
    await gym.start_participants(restore.restore_id, skip_resources_restore=True)
    episodes.start(task, "neg-a1", "continue", restore.restore_id)
    reply = await episodes.reply("neg-a1")
    assert reply["response"]["answer"] == expected_answer(task)
    assert reply["result"]["verdict"] == {"reward": 0.0, "answer_ok": True, "counter": 1}
    assert reply["reward"] == 0.0
    assert (await gym.stats("counter"))["restored"] == {"neg-a1": 0}


async def test_a_checkpoint_without_a_crash_disturbs_nothing(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """5: episodes parked mid-flight, a checkpoint, released: every call made exactly once."""
    run, trainer = gym.run, gym_trainer
    tasks = [
        make_task("q0"),
        make_task("q1", resources="verifier"),
        make_task("q2", resources="restart"),
        make_task("q3", rounds=1, tokens=96),
    ]
    holds = [
        ("agent", "after_tool_round", "q0", 0),
        ("agent", "after_tool_round", "q1", 0),
        ("agent", "before_model_call", "q2", 0),
        ("policy", "mid_generation", "q3", 48),
    ]
    for name, point, key, tokens in holds:
        await gym.hold(name, point, key, after_tokens=tokens)
    for task in tasks:
        episodes.start(task)
    for name, point, key, _ in holds:
        await episodes.held(name, point, key)
    checkpoint = await trainer.checkpoint(run)
    assert dict(checkpoint.counts) == {"continue": 3, "restart": 1, "finished": 0}
    for name, point, key, _ in holds:
        await gym.release(name, point, key)
    replies = await asyncio.gather(*(episodes.reply(str(t["id"])) for t in tasks))
    assert [right(reply, task) for reply, task in zip(replies, tasks, strict=True)] == [True] * 4
    policy, agent = await gym.stats("policy"), await gym.stats("agent")
    for task in tasks:
        key, count = str(task["id"]), int(task["tokens"])
        expected = [(f"{key}.c{n}", f"{key}.c{n - 1}" if n else None, 0, count) for n in range(3)]
        assert calls_of(policy, key) == expected[: int(task["rounds"]) + 1]
        assert [r["resumed"] for r in runs_of(agent, key)] == [None]
    after = await trainer.checkpoint(run)
    assert dict(after.counts) == {"continue": 0, "restart": 0, "finished": 4}


@pytest.mark.parametrize("policy_workers", [2])
async def test_a_second_crash_before_and_after_the_replacement_starts(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """8: crash, restore, a checkpoint and a crash before the replacements ran (an unconsumed
    generation cut survives it), restore again; then a replacement parks after a round, a
    checkpoint, a crash, and the third attempt continues from the second's boundary."""
    run, trainer = gym.run, gym_trainer
    task, cut_task = make_task("twice"), make_task("cut", rounds=1, tokens=96)
    await gym.hold("agent", "after_tool_round", "twice")
    await gym.hold("policy", "mid_generation", "cut", after_tokens=48)
    episodes.start(task)
    episodes.start(cut_task)
    await episodes.held("agent", "after_tool_round", "twice")
    await episodes.held("policy", "mid_generation", "cut")
    await trainer.checkpoint(run)
    gym.kill_participants()
    await episodes.cut_off(["twice", "cut"])
    first = await trainer.restore(run)
    await gym.start_participants(first.restore_id)

    # Before the replacements start: a checkpoint and a second crash.
    second_checkpoint = await trainer.checkpoint(run)
    assert dict(second_checkpoint.counts) == {"continue": 2, "restart": 0, "finished": 0}
    gym.kill_participants()
    second = await trainer.restore(run)
    assert await plan_of(trainer, run, second.restore_id) == {
        "twice": (1, 2, "continue"),
        "cut": (1, 2, "continue"),
    }
    cut = (await trainer.projection(run, "cut", restore=second.restore_id))["generation_cut"]
    assert (cut["call_id"], cut["token_ids"]) == ("cut.c0", sim_tokens("cut", 0, 96)[:48])
    await gym.start_participants(second.restore_id)
    await gym.hold("agent", "after_tool_round", "twice-a2")
    episodes.start(task, "twice-a2", "continue", second.restore_id)
    episodes.start(cut_task, "cut-a2", "continue", second.restore_id)
    assert right(await episodes.reply("cut-a2"), cut_task)
    assert (await episodes.held("agent", "after_tool_round", "twice-a2"))["round"] == 2
    policy = await gym.stats("policy")
    assert calls_of(policy, "twice-a2") == [("twice-a2.c1", "twice.c0", 0, 48)]
    assert calls_of(policy, "cut-a2") == [("cut.c0", None, 48, 48), ("cut-a2.c1", "cut.c0", 0, 96)]
    assert policy["parents"]["other_worker"] == 1  # cut-a2.c1's parent: the cut, on the other

    # After the replacement started: a checkpoint and a third crash.
    third_checkpoint = await trainer.checkpoint(run)
    assert dict(third_checkpoint.counts) == {"continue": 1, "restart": 0, "finished": 1}
    gym.kill_participants()
    await episodes.cut_off(["twice-a2"])
    third = await trainer.restore(run)
    assert await plan_of(trainer, run, third.restore_id) == {"twice": (2, 3, "continue")}
    # Started without a restore id this time: each participant fetches the episode's
    # projection when the replacement reaches it (the restore id travels with the requests).
    await gym.start_participants()
    episodes.start(task, "twice-a3", "continue", third.restore_id)
    reply = await episodes.reply("twice-a3")
    assert right(reply, task)
    assert reply["resumed_stage"] == "invoke_agent"
    policy, agent = await gym.stats("policy"), await gym.stats("agent")
    assert [r["resumed"] for r in runs_of(agent, "twice-a3")] == [2]
    assert calls_of(policy, "twice-a3") == [("twice-a3.c2", "twice-a2.c1", 0, 48)]
    assert policy["installed"] == {"twice-a3": 2}  # twice.c0 and twice-a2.c1, fetched
    assert (await gym.stats("counter"))["restored"] == {"twice-a3": 2}


async def test_the_service_killed_during_a_checkpoint_with_episodes_in_flight(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """11, with live participants: the service is SIGKILLed while a checkpoint waits for a
    verify step; the participants never paused, the checkpoint is gone whole, and the next
    checkpoint, a crash of every participant and the restore continue both episodes."""
    run, trainer = gym.run, gym_trainer
    tasks = {"a": make_task("a"), "w": make_task("w", resources="verifier")}
    await gym.hold("agent", "after_tool_round", "a")
    await gym.hold("verifier", "in_verify", "w")
    for task in tasks.values():
        episodes.start(task)
    await episodes.held("agent", "after_tool_round", "a")
    await episodes.held("verifier", "in_verify", "w")
    pending = await trainer.checkpoint(run, wait=False, deadline_s=120)
    assert pending.status == "pending"

    gym.kill_service()
    await gym.start_service()
    assert (await trainer.get_checkpoint(run, pending.checkpoint_id)).status == "aborted"
    await gym.hold("environment", "before:return", "w")
    await gym.release("verifier", "in_verify", "w")
    await episodes.held("environment", "before:return", "w")
    checkpoint = await trainer.checkpoint(run)
    assert checkpoint.checkpoint_id > pending.checkpoint_id
    assert dict(checkpoint.counts) == {"continue": 2, "restart": 0, "finished": 0}

    gym.kill_participants()
    await episodes.cut_off(["a", "w"])
    restore = await trainer.restore(run)
    assert restore.checkpoint_id == checkpoint.checkpoint_id
    await gym.start_participants(restore.restore_id)
    for key, task in tasks.items():
        episodes.start(task, f"{key}-a1", "continue", restore.restore_id)
    a, w = await episodes.reply("a-a1"), await episodes.reply("w-a1")
    assert right(a, tasks["a"]) and right(w, tasks["w"])
    assert (w["resumed_stage"], a["resumed_stage"]) == ("return", "invoke_agent")
    assert calls_of(await gym.stats("policy"), "a-a1") == [
        ("a-a1.c1", "a.c0", 0, 48),
        ("a-a1.c2", "a-a1.c1", 0, 48),
    ]
