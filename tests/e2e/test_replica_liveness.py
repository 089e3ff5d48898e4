"""Checkpoints that survive the faults they can, on three ``rolloutlog serve`` replicas (Tansu +
PostgreSQL, ``--lease-s 3``, SIGKILL and SIGSTOP by PID), each with a measured bound:

- the replica that requested a pending checkpoint is SIGKILLed: a checkpoint asked through the
  others commits as soon as the dead one's lease lapsed (it is superseded), well within the
  dead one's deadline;
- an owner is SIGSTOPped past its lease while a checkpoint is pending: the checkpoint waits for
  the take-over and commits within its own deadline;
- two trainers race for the controller, each taking over and checkpointing: every answer is a
  commit or ``409 stale_controller``, never ``503``;
- a trainer client given the three URLs keeps checkpointing while one replica is killed and
  restarted under its id.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rolloutlog.errors import RolloutlogError, StaleController
from rolloutlog.trainer import AsyncTrainerClient
from tests import factories as f
from tests.api.conftest import TOKENS, wire
from tests.e2e._harness import REPLICA_LEASE_S, Appends, Deployment, Replicas
from tests.e2e.conftest import KAFKA_ONLY, RUN
from tests.e2e.test_replicas import (
    assert_folded,
    assert_whole_or_none,
    episode_events,
    setup_run,
    trainers,
)

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, KAFKA_ONLY]


def every_url(replicas: Replicas, epoch: int) -> AsyncTrainerClient:
    """A trainer client given every replica's URL, of the run's controller ``epoch``."""
    client = AsyncTrainerClient(replicas.urls, token=TOKENS["admin"], timeout_s=60)
    client.controller_epochs[RUN] = epoch
    return client


async def wait_step_owned_by(appends: Appends, replicas: Replicas, name: str) -> tuple[str, str]:
    """Appends episodes at an open wait step until one lands in a partition owned by a replica;
    returns (episode, owner)."""
    leases = await replicas.catalog.leases(RUN)
    for index in range(40):
        episode = f"{name}{index}"
        await appends.ok(replicas.members[index % 3], episode_events(episode, wait=True))
        owner = leases[appends.acked[-1].partition][0]
        if owner is not None:
            return episode, owner
    raise AssertionError("no wait step landed in an owned partition")


@pytest.mark.timeout(120)
async def test_a_killed_requesters_checkpoint_is_superseded(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """The requester (also the owner of the wait step's partition, which holds its checkpoint
    pending for 30 s) is SIGKILLed: a trainer client given every URL gets the next checkpoint
    committed within the lease plus a few seconds: never the dead one's whole deadline."""
    async with trainers(three.members) as clients:
        await setup_run(three, clients, three.members)
        epoch = clients[three.members[0].url].controller_epochs[RUN]
        for index in range(6):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        _, owner = await wait_step_owned_by(appends, three, "w")
        victim = three[owner]
        orphan = await clients[victim.url].checkpoint(RUN, wait=False, deadline_s=30)
        assert orphan.status == "pending"
        victim.kill()
        killed = time.monotonic()
        async with every_url(three, epoch) as trainer:
            # Its wait step stays open: the new checkpoint restarts that episode at 2 s.
            checkpoint = await trainer.checkpoint(RUN, deadline_s=2)
        took_s = time.monotonic() - killed
        assert checkpoint.status == "committed", checkpoint
        assert checkpoint.checkpoint_id == orphan.checkpoint_id + 1
        # The lease lapses (3 s), the survivors claim and rebuild (a tick), 2 s of deadline.
        assert took_s < REPLICA_LEASE_S + 2 + 7, took_s
        ended = await assert_whole_or_none(three.catalog, orphan.checkpoint_id)
        assert ended["status"] == "aborted" and "superseded" in ended["reason"], ended
        print(f"killed requester -> next checkpoint committed in {took_s:.2f} s")
        survivor = next(r for r in three.members if r is not victim)
        await assert_folded(clients[survivor.url], appends, deployment.log_url or "")


@pytest.mark.timeout(120)
async def test_an_owner_paused_past_its_lease_is_taken_over_within_the_deadline(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """r3 is SIGSTOPped for 8.1 s just before a checkpoint (deadline 8 s) is asked of r1: its
    partitions' markers wait for their new owners, whose projectors start afresh, meet them
    caught up and write their parts; the checkpoint commits within its deadline."""
    r1, r2, r3 = three.members
    async with trainers(three.members) as clients:
        await setup_run(three, clients, three.members)
        for index in range(9):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        assert (await clients[r1.url].checkpoint(RUN)).status == "committed"
        for index in range(9, 12):
            await appends.ok(r2, episode_events(f"e{index}"))
        r3.pause()
        paused = time.monotonic()
        try:
            request = asyncio.create_task(clients[r1.url].checkpoint(RUN, deadline_s=8))
            await three.catalog.pending_checkpoint(RUN)
            await asyncio.sleep(0.5)  # its markers are in the log
            # Records after the markers: a new owner's catch-up reads past them.
            for index in range(12, 24):
                await appends.ok(r2, episode_events(f"e{index}"))
            await asyncio.wait({request}, timeout=8.1 - (time.monotonic() - paused))
            took_s = time.monotonic() - paused
            await asyncio.sleep(max(0.0, 8.1 - took_s))
        finally:
            r3.resume()
        assert request.done(), "not answered while r3 was paused"
        checkpoint = await request
        assert checkpoint.status == "committed", checkpoint
        assert dict(checkpoint.counts) == {
            "continue": 12,
            "restart": 0,
            "finished": 0,
        }  # at the cut
        parts = (await three.catalog.checkpoint(RUN, checkpoint.checkpoint_id))["parts"]
        assert "r3" not in {owner for owner, _ in parts.values()}, parts
        print(f"owner paused -> checkpoint committed in {took_s:.2f} s (deadline 8 s)")
        await assert_folded(clients[r2.url], appends, deployment.log_url or "")


@pytest.mark.timeout(120)
async def test_a_controller_race_answers_commits_or_stale_controller(
    three: Replicas, appends: Appends
) -> None:
    """Two trainers, each given every URL, take the controller over and ask for a checkpoint
    in turn as fast as they can: each answer is a commit or ``409 stale_controller``."""
    async with trainers(three.members) as clients:
        await setup_run(three, clients, three.members)
        for index in range(6):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        await wait_step_owned_by(appends, three, "w")  # holds checkpoints for their deadline
        outcomes: list[str] = []

        async def race(seat: int) -> None:
            async with every_url(three, 0) as trainer:
                trainer._urls._at = seat  # type: ignore[union-attr]  # on different replicas
                for _ in range(4):
                    await trainer.take_over(RUN)
                    try:
                        checkpoint = await trainer.checkpoint(RUN, deadline_s=1.5)
                    except StaleController:
                        outcomes.append("stale_controller")
                        continue
                    except RolloutlogError as e:
                        outcomes.append(f"{e.code}: {e.message}")
                        continue
                    outcomes.append(checkpoint.status)

        started = time.monotonic()
        await asyncio.gather(race(0), race(1))
        assert set(outcomes) <= {"committed", "stale_controller"}, outcomes
        assert "committed" in outcomes, outcomes
        assert time.monotonic() - started < 8 * (1.5 + 10)
        print("controller race:", outcomes)


@pytest.mark.timeout(150)
async def test_a_client_with_every_url_keeps_checkpointing_through_a_kill(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """A trainer given the three URLs checkpoints every 0.5 s (deadline 8 s); r2 is SIGKILLed
    and restarted under its id: every call commits, none takes longer than its deadline plus
    the grace, and the ids only grow."""
    r1, r2, r3 = three.members
    async with trainers(three.members) as clients:
        await setup_run(three, clients, three.members)
        epoch = clients[r1.url].controller_epochs[RUN]
        ids: list[int] = []
        longest = 0.0
        async with every_url(three, epoch) as trainer:
            trainer._urls._at = 1  # type: ignore[union-attr]  # start at r2, the victim

            async def checkpoints(seconds: float) -> None:
                nonlocal longest
                until = time.monotonic() + seconds
                index = len(ids)
                while time.monotonic() < until:
                    await appends.ok(r1 if index % 2 else r3, episode_events(f"e{index}"))
                    index += 1
                    started = time.monotonic()
                    checkpoint = await trainer.checkpoint(RUN, deadline_s=8)
                    longest = max(longest, time.monotonic() - started)
                    assert checkpoint.status == "committed", checkpoint
                    ids.append(checkpoint.checkpoint_id)
                    await asyncio.sleep(0.5)

            await checkpoints(2)
            r2.kill()
            await checkpoints(8)
            await r2.start()
            await checkpoints(6)
            await appends.ok(r2, wire(f.boundary("e0", "seed", {"turn": 2})))
        assert ids == sorted(set(ids)), ids
        assert longest < 8 + 10, longest
        print(f"{len(ids)} checkpoints through a kill and a restart; longest {longest:.2f} s")
        await assert_folded(clients[r3.url], appends, deployment.log_url or "")
