"""Export-on-checkpoint sessions in the crash suite: the sandbox resources server
keeps its counters in a SQLite file of its own; the checkpoint asks it to export (a snapshot
reference), waits for the export, and the replacement attempt restores the snapshot. Every
participant process is SIGKILLed between the checkpoint and the restore; both deployments."""

from __future__ import annotations

import pytest

from rolloutlog.participants.sim import Gym, expected_answer, make_task
from rolloutlog.trainer import AsyncTrainerClient
from tests.e2e._gym import Episodes

pytestmark = pytest.mark.slow


async def _checkpoint_parked_and_crash(
    gym: Gym, trainer: AsyncTrainerClient, episodes: Episodes, key: str
) -> int:
    """A sandbox episode parked after its first tool round, a checkpoint, every process killed,
    a restore: returns the restore id."""
    run = gym.run
    await gym.hold("agent", "after_tool_round", key)
    episodes.start(make_task(key, resources="sandbox"))
    assert (await episodes.held("agent", "after_tool_round", key))["round"] == 1
    checkpoint = await trainer.checkpoint(run, deadline_s=30)
    assert dict(checkpoint.counts) == {"continue": 1, "restart": 0, "finished": 0}
    assert (await gym.stats("sandbox"))["exports"] == 1  # asked for and given before the commit
    gym.kill_participants()
    await episodes.cut_off([key])
    restore = await trainer.restore(run)
    assert dict(restore.counts) == {"continue": 1, "restart": 0, "excluded": 0}
    return restore.restore_id


async def test_a_sandbox_session_is_exported_at_the_checkpoint_and_restored(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    restore_id = await _checkpoint_parked_and_crash(gym, gym_trainer, episodes, "sbx")
    await gym.start_participants(restore_id)
    task = make_task("sbx", resources="sandbox")
    episodes.start(task, "sbx-a1", "continue", restore_id)
    reply = await episodes.reply("sbx-a1")
    assert reply["response"]["answer"] == expected_answer(task)
    assert reply["result"]["verdict"] == {"reward": 1.0, "answer_ok": True, "counter": 2}
    assert (await gym.stats("sandbox"))["restored"] == {"sbx-a1": 1}


async def test_the_sandbox_reward_needs_the_restored_snapshot(
    gym: Gym, gym_trainer: AsyncTrainerClient, episodes: Episodes
) -> None:
    """Negative control: the replacement sandbox ignores the snapshot and the reward is wrong."""
    restore_id = await _checkpoint_parked_and_crash(gym, gym_trainer, episodes, "sbxneg")
    await gym.start_participants(restore_id, skip_resources_restore=True)
    task = make_task("sbxneg", resources="sandbox")
    episodes.start(task, "sbxneg-a1", "continue", restore_id)
    reply = await episodes.reply("sbxneg-a1")
    assert reply["result"]["verdict"] == {"reward": 0.0, "answer_ok": True, "counter": 1}
    assert (await gym.stats("sandbox"))["restored"] == {"sbxneg-a1": 0}
