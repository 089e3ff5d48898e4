"""Scenario 10: a zombie participant from before the crash cannot change the restored state.

The old environment and resources processes are not dead, only cut off: after the restore their
replacements register (a higher epoch) and continue the episodes as attempt 1, and then the
zombies write again: a session state and a finish for the fenced attempt 0, and a session state
for attempt 1 under the old epoch. Over HTTP the service refuses each; straight into Kafka nothing
refuses them, they land in the log before the next checkpoint's markers, and the next checkpoint
and restore must ignore them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rolloutlog.trainer import AsyncTrainerClient
from tests.e2e._harness import Deployment, Puppet, PuppetError
from tests.e2e.conftest import RUN

pytestmark = pytest.mark.slow

EPISODES = ("e0", "e1")


async def start(puppets: Callable[[str], Puppet], deployment: Deployment, name: str) -> Puppet:
    puppet = puppets(name)
    await puppet.open(deployment)
    return puppet


async def test_a_zombie_cannot_change_the_restored_state(
    deployment: Deployment,
    trainer: AsyncTrainerClient,
    puppets: Callable[[str], Puppet],
) -> None:
    old_env = await start(puppets, deployment, "env")
    old_res = await start(puppets, deployment, "res")
    assert await old_env.participant("env", "environment", "env-0") == 1
    assert await old_res.participant("res", "resources", "res-0", mode="exported") == 1
    for episode in EPISODES:
        await old_env.call("env", "start_episode", episode, {"task": episode}, as_=episode)
        await old_res.call("res", "open_session", episode, f"s-{episode}", state={"counter": 1})
        await old_env.call(episode, "boundary", "seed", {"session": f"s-{episode}"})
        await old_res.call("res", "record_state", episode, f"s-{episode}", {"counter": 2})
        await old_env.call(episode, "boundary", "invoke_agent", {"turn": 1})
    first = await trainer.checkpoint(RUN)
    assert dict(first.counts) == {"continue": 2, "restart": 0, "finished": 0}

    restore = await trainer.restore(RUN)
    assert dict(restore.counts) == {"continue": 2, "restart": 0, "excluded": 0}
    env = await start(puppets, deployment, "env-2")
    res = await start(puppets, deployment, "res-2")
    assert await env.participant("env", "environment", "env-0") == 2
    assert await res.participant("res", "resources", "res-0", mode="exported") == 2
    projection = await res.call("restores", "fetch", RUN, "e0", restore.restore_id)
    assert projection["capture_key"] == "e0-a1"
    assert await res.call("res", "restored_state", projection, "s-e0") == {"counter": 2}
    await res.call("res", "record_state", "e0-a1", "s-e0", {"counter": 3})
    resumed = await env.call("env", "resume", projection, as_="resumed")
    assert (resumed["stage"], resumed["state"]) == ("close_agent", {"turn": 1})
    await env.send({"op": "get", "target": "resumed", "attr": "episode", "as": "e0-a1"})
    await env.call("e0-a1", "boundary", "close_agent", {"observations": "o"})

    # The zombies write again.
    zombie_writes = [
        (old_res, "res", "record_state", ("e0", "s-e0", {"counter": 999}), "attempt_fenced"),
        (old_res, "res", "record_state", ("e0-a1", "s-e0", {"counter": 666}), "participant_fenced"),
        (old_env, "e1", "finish", (0.0, {"by": "zombie"}), "attempt_fenced"),
    ]
    positions = []
    for puppet, target, method, args, refusal in zombie_writes:
        if deployment.transport == "http":
            with pytest.raises(PuppetError) as refused:
                await puppet.call(target, method, *args)
            assert refused.value.code == refusal
        else:
            positions.append(await puppet.call(target, method, *args))

    second = await trainer.checkpoint(RUN)
    # The zombie's finish did not finish e1: it still continues.
    assert dict(second.counts) == {"continue": 2, "restart": 0, "finished": 0}
    markers = {o["partition"]: o["marker"] for o in second.offsets}
    for position in positions:  # on Kafka the zombie's records are inside the checkpoint
        assert position["offset"] < markers[position["partition"]]
    again = await trainer.restore(RUN)
    assert dict(again.counts) == {"continue": 2, "restart": 0, "excluded": 0}
    e0 = await res.call("restores", "fetch", RUN, "e0", again.restore_id)
    e1 = await res.call("restores", "fetch", RUN, "e1", again.restore_id)
    assert (e0["capture_key"], e1["capture_key"]) == ("e0-a2", "e1-a2")
    assert e0["sessions"]["s-e0"]["state"] == {"counter": 3}
    assert e0["boundaries"]["environment"]["stage"] == "close_agent"
    assert e1["sessions"]["s-e1"]["state"] == {"counter": 2}
    assert e1["boundaries"]["environment"]["stage"] == "invoke_agent"
