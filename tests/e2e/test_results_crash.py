"""On both deployments: results whose replies a crash lost come back from the service,
once, with the right reward, and their rollouts are never dispatched again.

The rollout collector is a real process (``tests.results._dispatch``) SIGKILLed while the
environment holds its replies (after ``episode.finished`` is durable); then the Gym's
participants are SIGKILLed and the trainer resumes with ``resume_run``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import orjson
import pytest

from rolloutlog.participants.sim import Gym, expected_answer, expected_reward, make_task
from rolloutlog.trainer import AsyncTrainerClient, resume_run
from tests._services import ROOT
from tests.e2e._gym import Episodes, runs_of

pytestmark = pytest.mark.slow


def dispatcher(gym: Gym, tasks: list[dict[str, object]]) -> subprocess.Popen[bytes]:
    """The collector process: it dispatches the tasks and waits for replies it never reads."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.results._dispatch",
            gym.url("environment"),
            orjson.dumps(tasks).decode(),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_results_lost_with_the_collector_come_back_once_and_are_not_dispatched_again(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    run, trainer = gym.run, gym_trainer
    tasks = {key: make_task(key) for key in ("early", "late", "live")}
    # early finishes before the checkpoint, late after it; both replies are held back.
    await gym.hold("environment", "after_finish", "early")
    await gym.hold("environment", "after_finish", "late")
    await gym.hold("agent", "after_tool_round", "late")
    await gym.hold("agent", "after_tool_round", "live")
    collector = dispatcher(gym, list(tasks.values()))
    try:
        await gym.wait_held("environment", "after_finish", "early")
        await gym.wait_held("agent", "after_tool_round", "late")
        await gym.wait_held("agent", "after_tool_round", "live")
        checkpoint = await trainer.checkpoint(run)
        assert dict(checkpoint.counts) == {"continue": 2, "restart": 0, "finished": 1}
        await gym.release("agent", "after_tool_round", "late")
        await gym.wait_held("environment", "after_finish", "late")
        # The collector dies before it reads either reply, then the Gym crashes.
        collector.send_signal(signal.SIGKILL)
        assert collector.wait(timeout=10) == -signal.SIGKILL
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait()
    gym.kill_participants()

    plan = await resume_run(trainer, run)
    assert [(r.episode, r.attempt, r.reward) for r in plan.results] == [
        ("early", 0, expected_reward(tasks["early"])),
        ("late", 0, expected_reward(tasks["late"])),
    ]
    assert plan.results[1].result["answer"] == expected_answer(tasks["late"])
    assert [(d.episode, d.action, d.capture_key) for d in plan.dispatch] == [
        ("live", "continue", "live-a1")
    ]
    assert plan.excluded == ("late",) and plan.finished == ("early",)
    assert plan.restore is not None and plan.restore.raw["unacknowledged_results"] == 2

    await gym.start_participants(plan.restore_id)
    episodes.start(tasks["live"], "live-a1", "continue", plan.restore_id)
    reply = await episodes.reply("live-a1")
    assert reply["reward"] == expected_reward(tasks["live"])
    # Acknowledging twice changes nothing.
    held = [r.episode for r in plan.results] + ["live"]
    assert await trainer.ack_results(run, held) == 3
    assert await trainer.ack_results(run, held) == 0
    assert await trainer.results(run, unacknowledged=True) == []

    # Another crash: an acknowledged result never comes back, and nothing runs twice.
    gym.kill_participants()
    again = await resume_run(trainer, run)
    assert again.results == () and again.dispatch == ()
    assert sorted(again.excluded) == ["late", "live"]
    await gym.start_participants(again.restore_id)
    environment = await gym.stats("environment")
    assert runs_of(environment, "late") == runs_of(environment, "late-a1") == []
    every = {r.episode: r for r in await trainer.results(run)}
    assert {e: (r.attempt, r.reward, r.acknowledged) for e, r in every.items()} == {
        "early": (0, 1.0, True),
        "late": (0, 1.0, True),
        "live": (1, 1.0, True),
    }


async def test_the_sim_collector_recovers_results_instead_of_losing_them(gym: Gym) -> None:
    tasks = [make_task(key) for key in ("r0", "r1", "r2")]
    await gym.hold("environment", "after_finish", "r1")
    await gym.hold("agent", "after_tool_round", "r2")
    async with gym.collector(concurrency=4) as collector:
        runner = asyncio.create_task(collector.run(tasks, timeout_s=120))
        await collector.wait_done(1)
        await gym.wait_held("environment", "after_finish", "r1")
        await gym.wait_held("agent", "after_tool_round", "r2")
        await collector.checkpoint(pause=True)
        gym.kill_participants()  # r1's reply is lost with the environment
        plan = await collector.restore()
        assert [r.episode for r in plan.results] == ["r1"]  # r0's was acknowledged
        assert [d.episode for d in plan.dispatch] == ["r2"]
        await gym.start_participants(plan.restore_id)
        collector.redispatch()
        report = await runner
    assert report.ok and report.lost == [] and report.recovered == ["r1"]
    assert report.right == 3 and report.continued == 1
