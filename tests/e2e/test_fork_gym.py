"""The fork demo on the simulated Gym, on both deployments (embedded with HTTP appends; Kafka and
PostgreSQL with participants appending straight to Kafka): a trainer forks a live run from its
latest checkpoint and resumes the fork under another policy version, in the same participant
processes as the original; both runs finish with every reward right."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rolloutlog.participants.sim import Gym, make_task
from rolloutlog.trainer import AsyncTrainerClient
from tests.e2e._gym import gym_for
from tests.e2e._harness import Deployment

pytestmark = pytest.mark.slow

FORK = "sim-fork"
#: Counter tasks (an exported session whose restored state the reward needs), a verifier task
#: (stateless) and a longer one.
TASKS = [
    make_task("f0"),
    make_task("f1", rounds=3),
    make_task("f2", resources="verifier"),
    make_task("f3", rounds=1, tokens=96),
]


@pytest.fixture
async def fork_gym(deployment: Deployment) -> AsyncIterator[Gym]:
    running = gym_for(deployment, verifier_verify="wait", fork_policy_version=2)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def ledger_versions(history: dict[str, Any]) -> set[tuple[int, int]]:
    """(attempt, policy version) of the ledger rows an episode's history shows."""
    return {(row["attempt"], row["policy_version"]) for row in history["ledger"]}


async def test_a_fork_of_a_live_run_finishes_beside_it_under_another_policy_version(
    fork_gym: Gym,
) -> None:
    gym = fork_gym
    for task in TASKS:  # every episode parks after its first tool round, in the source run
        await gym.hold("agent", "after_tool_round", task["id"])
    async with (
        AsyncTrainerClient(gym.service_url, timeout_s=60) as trainer,
        gym.collector(concurrency=len(TASKS)) as source,
    ):
        running = asyncio.create_task(source.run(TASKS, timeout_s=300))
        for task in TASKS:
            await gym.wait_held("agent", "after_tool_round", task["id"])
        await trainer.take_over(gym.run)
        checkpoint = await trainer.checkpoint(gym.run)
        assert checkpoint.counts["continue"] == len(TASKS)

        # Fork the live run from its latest checkpoint; resume the fork beside it.
        forked = await trainer.fork_run(FORK, gym.run, "latest")
        assert forked["forked_from"]["checkpoint_id"] == checkpoint.checkpoint_id
        async with gym.collector(FORK, concurrency=len(TASKS)) as branch:
            branch.adopt(TASKS)
            plan = await branch.restore()
            assert {d.episode: d.action for d in plan.dispatch} == {
                task["id"]: "continue" for task in TASKS
            }
            branch.redispatch()
            branch_report = await branch.run(timeout_s=300)
        # Meanwhile the source's episodes are still parked: let them finish their own way.
        assert not running.done()
        assert await gym.release("agent") == len(TASKS)
        source_report = await running
        assert source_report.right == len(TASKS), source_report
        assert branch_report.right == len(TASKS), branch_report
        assert branch_report.continued == len(TASKS)
        assert not source_report.wrong and not branch_report.wrong

        # The same policy process served both runs, each at its own version.
        calls = (await gym.stats("policy"))["calls"]
        by_run = {(c["run"], c["policy_version"]) for c in calls if c["delivered"]}
        assert by_run == {(gym.run, 1), (FORK, 2)}
        fork_keys = {c["capture_key"] for c in calls if c["run"] == FORK}
        assert fork_keys == {f"{task['id']}-a1" for task in TASKS}
        counter = await gym.stats("counter")
        assert (
            counter["restored"][f"{FORK}/f0-a1"] == 1
        )  # the fork's session, restored from its cut
        assert counter["sessions"] == {}  # every session closed, in both runs

        # In the fork, each episode's ledger holds the source's rows (version 1, attempt 0) and the
        # fork's own (version 2, attempt 1); the source's episodes never saw version 2.
        for task in TASKS:
            ours = await trainer.episode_history(FORK, task["id"])
            theirs = await trainer.episode_history(gym.run, task["id"])
            assert ledger_versions(ours) == {(0, 1), (1, 2)}, task["id"]
            assert ledger_versions(theirs) == {(0, 1)}, task["id"]
            assert ours["forked_from"]["checkpoint_id"] == checkpoint.checkpoint_id
