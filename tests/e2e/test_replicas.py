"""Several ``rolloutlog serve`` replicas on one Kafka (Tansu) log and one PostgreSQL
catalog form one service. Real processes, SIGKILL and SIGSTOP/SIGCONT by PID, a short lease
(``REPLICA_LEASE_S``) so that failover takes seconds.

Every test ends with the same two checks: each event a replica acknowledged is in the log at the
position it answered (``Appends.check_log``), and in the fold: its episode is in the manifest of
a checkpoint committed after every failover (``assert_folded``; in the Gym's test, the result and
reward the service kept for every rollout); an append that was not acknowledged was refused
(``Appends.refused``), never half-taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from rolloutlog.errors import RolloutlogError
from rolloutlog.participants.sim import Gym, expected_reward, make_tasks
from rolloutlog.trainer import AsyncTrainerClient, CheckpointInfo
from tests import factories as f
from tests.api.conftest import TOKENS, wire
from tests.e2e._gym import CHUNK_TOKENS, TOKEN_RATE
from tests.e2e._harness import (
    REPLICA_LEASE_S,
    Appends,
    CatalogView,
    Deployment,
    Replica,
    Replicas,
    Service,
)
from tests.e2e.conftest import KAFKA_ONLY, RUN, start_replicas

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, KAFKA_ONLY]

PARTITIONS = 6
T = TypeVar("T")


@contextlib.asynccontextmanager
async def trainers(replicas: Sequence[Service]) -> AsyncIterator[dict[str, AsyncTrainerClient]]:
    """An admin trainer client per replica (keyed by URL), sharing the run's controller epoch
    once ``take_over`` is called on any of them (``share_epoch``)."""
    clients = {
        r.url: AsyncTrainerClient(r.url, token=TOKENS["admin"], timeout_s=60) for r in replicas
    }
    try:
        yield clients
    finally:
        for client in clients.values():
            await client.stop()


def share_epoch(clients: dict[str, AsyncTrainerClient], run: str, epoch: int) -> None:
    for client in clients.values():
        client.controller_epochs[run] = epoch


async def retrying(call: Callable[[], Awaitable[T]], timeout_s: float = 40.0) -> T:
    """``call`` again while it is refused with a retriable error (a lease moving, a dead
    replica's checkpoint still pending until it is swept), as a trainer's retry would."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except RolloutlogError as e:
            if time.monotonic() > deadline or not e.retriable:
                raise
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def episode_events(episode: str, *, wait: bool = False) -> list[dict[str, Any]]:
    """An episode at its seed boundary (a ``continue`` in a manifest); ``wait``: at a wait step
    instead, which holds a checkpoint of its partition pending until its boundary."""
    if wait:
        return wire(f.started(episode), f.step_started(episode, "seed", mode="wait"))
    return wire(
        f.started(episode),
        f.step_started(episode, "seed"),
        f.boundary(episode, "seed", {"turn": 1}),
    )


async def setup_run(
    replicas: Replicas, clients: dict[str, AsyncTrainerClient], members: list[Replica]
) -> dict[int, tuple[str | None, int]]:
    """Create the run through the first member, take it over, register ``env-0`` (epoch 1)
    through the last; returns the leases once every member owns some partitions."""
    first, last = clients[members[0].url], clients[members[-1].url]
    await first.create_run(RUN, partitions=PARTITIONS)
    share_epoch(clients, RUN, await first.take_over(RUN))
    assert await last.register_participant(RUN, "env-0", "environment") == 1
    return await replicas.catalog.wait_owned(RUN, PARTITIONS, {r.replica_id for r in members})


async def assert_whole_or_none(catalog: CatalogView, checkpoint_id: int) -> dict[str, Any]:
    """A checkpoint that ended committed has a part and offsets for every partition; one that
    aborted kept none of the parts some owners wrote (and is not what ``latest`` names: checked
    by the caller)."""
    checkpoint = await catalog.wait_checkpoint_ended(RUN, checkpoint_id)
    every = set(range(PARTITIONS))
    if checkpoint["status"] == "committed":
        assert set(checkpoint["parts"]) == every, checkpoint
        assert checkpoint["offset_partitions"] == every, checkpoint
    else:
        assert checkpoint["status"] == "aborted", checkpoint
        assert not checkpoint["parts"] and not checkpoint["manifest_partitions"], checkpoint
    return checkpoint


async def assert_folded(
    client: AsyncTrainerClient, appends: Appends, log_url: str
) -> CheckpointInfo:
    """Every acknowledged event is in the log, and every acknowledged episode in the manifest of
    a checkpoint committed now (through ``client``'s replica)."""
    await appends.check_log(log_url)
    checkpoint = await retrying(lambda: client.checkpoint(RUN, deadline_s=15))
    assert checkpoint.status == "committed", checkpoint
    manifest = {e["episode"] async for e in client.manifest(RUN, checkpoint.checkpoint_id)}
    missing = appends.episodes() - manifest
    assert not missing, f"acknowledged episodes not in the fold: {sorted(missing)}"
    return checkpoint


# -- the tests ----------------------------------------------------------------------------------


async def test_three_replicas_serve_every_route(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """Appends through all three; a checkpoint requested from r1 has a part per partition, each
    by its owner; a restore requested from r2 commits; r3 serves its projections."""
    r1, r2, r3 = three.members
    async with trainers(three.members) as clients:
        leases = await setup_run(three, clients, three.members)
        assert {owner for owner, _ in leases.values()} == {"r1", "r2", "r3"}
        for index in range(12):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        episodes = appends.episodes()
        assert len({a.partition for a in appends.acked}) > 1

        checkpoint = await clients[r1.url].checkpoint(RUN)
        assert checkpoint.status == "committed", checkpoint
        assert dict(checkpoint.counts) == {"continue": 12, "restart": 0, "finished": 0}
        parts = (await three.catalog.checkpoint(RUN, checkpoint.checkpoint_id))["parts"]
        assert parts == leases  # each partition's part by its owner at its generation
        manifest = {
            e["episode"]: e["action"]
            async for e in clients[r3.url].manifest(RUN, checkpoint.checkpoint_id)
        }
        assert manifest == dict.fromkeys(episodes, "continue")

        restore = await clients[r2.url].restore(RUN)
        assert restore.checkpoint_id == checkpoint.checkpoint_id
        assert dict(restore.counts) == {"continue": 12, "restart": 0, "excluded": 0}
        request = (await three.catalog.restore_requests(RUN)).get(restore.restore_id)
        if request is not None:  # a restore planned by several owners went through the table
            assert request["status"] == "committed", request
        for episode in sorted(episodes):
            projection = await clients[r3.url].projection(RUN, episode, restore=restore.restore_id)
            assert projection["capture_key"] == f"{episode}-a1"
            assert projection["boundaries"]["environment"]["stage"] == "seed"

        # The replacement attempts append through any replica; a checkpoint from r3 folds them.
        epoch = await clients[r1.url].register_participant(RUN, "env-0", "environment")
        for index, episode in enumerate(sorted(episodes)):
            who = f.participant(epoch=epoch)
            event = f.boundary(episode, "close_agent", {"turn": 2}, attempt=1, who=who)
            await appends.ok(three.members[index % 3], wire(event))
        await assert_folded(clients[r3.url], appends, deployment.log_url or "")
    assert not appends.refused


async def test_sigkill_mid_checkpoint(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """The replica that requested a checkpoint, and owns the partition a wait step holds it
    pending in, is SIGKILLed: its partitions are owned again within the lease; the checkpoint
    commits whole or ends uncommitted (never partial, never ``latest``); the next one, from
    another replica, commits with parts by the survivors only."""
    async with trainers(three.members) as clients:
        leases = await setup_run(three, clients, three.members)
        for index in range(6):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        first = await clients[three.members[0].url].checkpoint(RUN)
        assert first.status == "committed"
        await appends.ok(three.members[1], episode_events("w", wait=True))
        held = next(a.partition for a in appends.acked if a.event["episode"] == "w")
        victim = three[str(leases[held][0])]
        survivors = [r for r in three.members if r is not victim]

        pending = await clients[victim.url].checkpoint(RUN, wait=False, deadline_s=4)
        assert pending.status == "pending"
        victim.kill()
        killed = time.monotonic()
        after = await three.catalog.wait_owned(
            RUN, PARTITIONS, {r.replica_id for r in survivors}, timeout_s=4 * REPLICA_LEASE_S + 10
        )
        failover_s = time.monotonic() - killed
        assert failover_s < 4 * REPLICA_LEASE_S + 5, failover_s
        for partition, (owner, generation) in after.items():
            assert owner == leases[partition][0] or generation > leases[partition][1]

        ended = await assert_whole_or_none(three.catalog, pending.checkpoint_id)
        latest = await clients[survivors[0].url].get_checkpoint(RUN, "latest")
        if ended["status"] != "committed":
            assert latest.checkpoint_id == first.checkpoint_id

        # The wait step ends (through a survivor); the next checkpoint commits after failover.
        await appends.ok(survivors[0], wire(f.boundary("w", "seed", {"turn": 1})))
        for index in range(6, 9):
            await appends.ok(survivors[index % 2], episode_events(f"e{index}"))
        last = await assert_folded(clients[survivors[1].url], appends, deployment.log_url or "")
        parts = (await three.catalog.checkpoint(RUN, last.checkpoint_id))["parts"]
        assert parts == await three.catalog.leases(RUN)  # by the survivors, at their generations


async def test_sigkill_mid_restore(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """The replica that took a restore is SIGKILLed while the other owners' plan parts wait on
    the catalog (held by the test): the request never commits (aborted past its deadline by a
    survivor); a restore requested again from another replica commits, and a third serves it."""
    r1, r2, r3 = three.members
    async with trainers(three.members) as clients:
        await setup_run(three, clients, three.members)
        for index in range(9):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        checkpoint = await clients[r2.url].checkpoint(RUN)
        assert checkpoint.status == "committed"

        catalog = three.catalog
        import asyncpg

        hold = await asyncpg.connect(catalog.dsn, server_settings={"search_path": catalog.schema})
        try:
            transaction = hold.transaction()
            await transaction.start()
            await hold.execute("LOCK TABLE restore_parts IN EXCLUSIVE MODE")
            request = asyncio.create_task(clients[r1.url].restore(RUN))
            deadline = time.monotonic() + 30
            while not any(
                r["status"] == "planning" for r in (await catalog.restore_requests(RUN)).values()
            ):
                assert not request.done(), request  # it must wait for the other owners' parts
                assert time.monotonic() < deadline, "the restore request never reached the catalog"
                await asyncio.sleep(0.02)
            r1.kill()
            with pytest.raises((httpx.TransportError, RolloutlogError)):
                await request
            await transaction.rollback()
        finally:
            await hold.close()
        dead = next(
            rid
            for rid, r in (await catalog.restore_requests(RUN)).items()
            if r["status"] == "planning"
        )
        # Its deadline (60 s) brought forward, as if that time had passed: a survivor's sweep
        # aborts it now (the restarted owners wait for its verdict until then).
        await catalog.fetch(
            "UPDATE restore_requests SET deadline_at = extract(epoch FROM clock_timestamp()) "
            "WHERE run = $1 AND restore_id = $2",
            RUN,
            dead,
        )

        # Asked again at once: while r1's partitions move, a request gives up (retriable).
        restore = await retrying(lambda: clients[r2.url].restore(RUN), timeout_s=60)
        assert restore.restore_id != dead
        assert dict(restore.counts) == {"continue": 9, "restart": 0, "excluded": 0}
        requests = await catalog.restore_requests(RUN)
        assert requests[dead]["status"] == "aborted", requests[dead]
        if restore.restore_id in requests:
            assert requests[restore.restore_id]["status"] == "committed"
        attempts = {
            e.episode: e.attempt
            async for e in clients[r3.url].restore_episodes(RUN, restore.restore_id)
        }
        for episode in sorted(appends.episodes()):
            projection = await clients[r3.url].projection(RUN, episode, restore=restore.restore_id)
            assert projection["capture_key"] == f"{episode}-a{attempts[episode]}"
            assert projection["boundaries"]["environment"]["stage"] == "seed"
        await assert_folded(clients[r3.url], appends, deployment.log_url or "")


async def test_sigstop_zombie_is_fenced(
    three: Replicas, deployment: Deployment, appends: Appends
) -> None:
    """r3 is SIGSTOPped in the middle of writing its part of a checkpoint (the test holds the
    run's catalog row, so r3's transaction is provably open), and its partitions move to r1 and
    r2 at new generations. SIGCONT: r3's write goes on and is refused (``LeaseLost``, in its
    log); no part is ever written under r3's old generations; the checkpoint commits whole or
    not at all; r3 rejoins at new generations and the next checkpoint commits with its parts."""
    r1, r2, r3 = three.members
    catalog = three.catalog
    async with trainers(three.members) as clients:
        before = await setup_run(three, clients, three.members)
        for index in range(6):
            await appends.ok(three.members[index % 3], episode_events(f"e{index}"))
        assert (await clients[r1.url].checkpoint(RUN)).status == "committed"
        fenced = {(p, g) for p, (owner, g) in before.items() if owner == "r3"}
        # A wait step in one of r3's partitions: r3 writes its part only when it ends.
        for index in range(40):
            await appends.ok(r1, episode_events(f"w{index}", wait=True))
            if appends.acked[-1].partition in {p for p, _ in fenced}:
                break
        waiting = appends.acked[-1].event["episode"]
        assert appends.acked[-1].partition in {p for p, _ in fenced}

        request = asyncio.create_task(
            retrying(lambda: clients[r1.url].checkpoint(RUN, wait=False, deadline_s=10))
        )
        pending = await catalog.pending_checkpoint(RUN)
        import asyncpg

        hold = await asyncpg.connect(catalog.dsn, server_settings={"search_path": catalog.schema})
        try:
            transaction = hold.transaction()
            await transaction.start()
            await hold.execute("SELECT 1 FROM runs WHERE run = $1 FOR UPDATE", RUN)
            for index in range(int(waiting[1:]) + 1):  # every wait step ends: r3 writes its part
                await appends.ok(r2, wire(f.boundary(f"w{index}", "seed", {"turn": 1})))
            deadline = time.monotonic() + 30
            while not await catalog.waiting_on_lock(r3.pid):
                assert time.monotonic() < deadline, "r3 never began writing its part"
                await asyncio.sleep(0.02)
            r3.pause()
            await transaction.rollback()  # r3's transaction takes the run's row, and sleeps
        finally:
            await hold.close()
        try:
            moved = await catalog.wait_owned(
                RUN, PARTITIONS, {"r1", "r2"}, timeout_s=4 * REPLICA_LEASE_S + 10
            )
            for partition, generation in fenced:
                assert moved[partition][1] > generation, (partition, moved[partition])
        finally:
            r3.resume()
        await request
        await assert_whole_or_none(catalog, pending)
        deadline = time.monotonic() + 10
        while "no longer owns partition" not in r3.tail():
            assert time.monotonic() < deadline, f"r3's part was not refused: {r3.tail()}"
            await asyncio.sleep(0.1)

        # Nothing r3 wrote under its old generations is in the catalog.
        rows = await catalog.fetch(
            "SELECT checkpoint_id, partition, generation FROM checkpoint_parts "
            "WHERE run = $1 AND replica_id = 'r3' AND checkpoint_id >= $2",
            RUN,
            pending,
        )
        assert not [r for r in rows if (r["partition"], r["generation"]) in fenced], rows

        back = await catalog.wait_owned(RUN, PARTITIONS, {"r1", "r2", "r3"}, timeout_s=30)
        for partition, (owner, generation) in back.items():
            if owner == "r3":
                assert generation > before[partition][1]
        for index in range(3):
            await appends.ok(r3, episode_events(f"z{index}"))
        last = await assert_folded(clients[r3.url], appends, deployment.log_url or "")
        parts = (await catalog.checkpoint(RUN, last.checkpoint_id))["parts"]
        assert parts == back, (parts, back)


class ReplicaGym(Gym):
    """The simulated Gym whose "service" is a load balancer (``tests/e2e/_balancer.py``) in
    front of replicas started by the test."""

    def __init__(self, replicas: Replicas, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.replicas = replicas

    def _spawn_service(self) -> None:
        backends = [f"127.0.0.1:{r.port}" for r in self.replicas]
        self._spawn(self.service, ["-m", "tests.e2e._balancer", str(self.service.port), *backends])


async def test_gym_on_two_replicas_one_killed_mid_run(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The simulated Gym (participants appending straight to Kafka) behind a load balancer in
    front of two replicas; one is SIGKILLed while rollouts run: every reward is right and every
    rollout's finish is in the fold (a checkpoint's manifest) afterwards."""
    replicas = await start_replicas(deployment, tmp_path, 2, tokens=False)
    gym = ReplicaGym(
        replicas,
        data_dir=deployment.data_dir / "gym",
        partitions=PARTITIONS,
        log_url=deployment.log_url,
        catalog_url=deployment.catalog_url,
        participant_transport=deployment.transport,
        token_rate=TOKEN_RATE,
        chunk_tokens=CHUNK_TOKENS,
    )
    try:
        await gym.start()
        await replicas.catalog.wait_owned(gym.run, PARTITIONS, {"r1", "r2"})
        tasks = make_tasks(16)
        async with gym.collector(concurrency=4) as collector:
            runner = asyncio.create_task(collector.run(tasks, timeout_s=100))
            await collector.wait_done(4, timeout_s=60)
            first = await collector.checkpoint()
            assert first.status == "committed", first
            replicas["r2"].kill()
            await replicas.catalog.wait_owned(
                gym.run, PARTITIONS, {"r1"}, timeout_s=4 * REPLICA_LEASE_S + 10
            )
            report = await runner
            assert report.ok, (report.wrong, report.lost, report.failed)
            assert report.finished == len(tasks)
            trainer = collector.trainer
            last = await retrying(lambda: trainer.checkpoint(gym.run, deadline_s=15))
            assert last.status == "committed", last
            # Every finish is in the fold: the service holds each rollout's result and reward, and
            # the last manifest names no rollout as anything but finished.
            results = await trainer.results(gym.run, episodes=[str(t["id"]) for t in tasks])
            assert {r.episode: r.reward for r in results} == {
                str(t["id"]): expected_reward(t) for t in tasks
            }
            manifest = {
                e["episode"]: e["action"]
                async for e in trainer.manifest(gym.run, last.checkpoint_id)
            }
            assert set(manifest.values()) <= {"finished"}, manifest
            parts = (await replicas.catalog.checkpoint(gym.run, last.checkpoint_id))["parts"]
            assert {owner for owner, _ in parts.values()} == {"r1"}
    finally:
        await gym.stop()
        replicas.stop()


async def test_one_replica_without_replica_flags(
    deployment: Deployment, tmp_path: Path, appends: Appends
) -> None:
    """``serve --log kafka://… --catalog postgresql…`` with no replica flag is one replica named
    ``<hostname>:<port>`` that owns every partition; SIGKILLed and restarted on its port, it
    takes its partitions back at once (a new generation, no lease to wait out)."""
    service = Service(deployment, tmp_path)
    await service.start()
    catalog = CatalogView(deployment.catalog_url or "")
    try:
        async with trainers([service]) as clients:
            client = clients[service.url]
            await client.create_run(RUN, partitions=PARTITIONS)
            share_epoch(clients, RUN, await client.take_over(RUN))
            assert await client.register_participant(RUN, "env-0", "environment") == 1
            me = f"{socket.gethostname()}:{service.port}"
            leases = await catalog.wait_owned(RUN, PARTITIONS, {me})
            for index in range(4):
                await appends.ok(service, episode_events(f"e{index}"))
            checkpoint = await client.checkpoint(RUN)
            assert dict(checkpoint.counts) == {"continue": 4, "restart": 0, "finished": 0}
            restore = await client.restore(RUN)
            assert dict(restore.counts) == {"continue": 4, "restart": 0, "excluded": 0}

            service.kill()
            await service.start()
            ready = time.monotonic()
            again = await catalog.wait_owned(RUN, PARTITIONS, {me}, timeout_s=10)
            assert all(again[p][1] > leases[p][1] for p in leases), (leases, again)
            for index in range(4, 6):
                await appends.ok(service, episode_events(f"e{index}"))
            await assert_folded(client, appends, deployment.log_url or "")
            # Well within the default lease (6 s): nothing waited for its own old lease to lapse.
            assert time.monotonic() - ready < 6.0
    finally:
        service.stop()
