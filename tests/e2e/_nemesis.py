"""The nemesis: a seeded random schedule of faults over three replicas, the Kafka broker and the
PostgreSQL catalog, under continuous appends through random replicas, checkpoints and restores;
the checkers of what it must keep (safety) and how soon it must get going again (liveness).

The world (``nemesis_world``): a private Tansu behind a resetting proxy (``tests/faults/_kafka.py``),
a throwaway PostgreSQL cluster (``tests/faults/_postgres.py``; never the machine's own), three
``rolloutlog serve --replica-id rN --lease-s 3`` on both. The workload (``Workload``): six writers
each appending 4-event batches (a new episode each, left live at its first boundary, so that every
later checkpoint's manifest names it) through a random replica; a trainer that every 0.5-1.5 s asks
for a checkpoint (``wait: true``, ``deadline_s: 8``) or, one request in 12, a restore of the latest,
through a client given every replica's URL (it moves on by itself). The faults, one at a time (``schedule``):

- ``replica_kill``: SIGKILL a replica, restart it under the same ``--replica-id`` 0.5-7 s later
  (before or after its lease ran out); ends when the new process answers ``/healthz``.
- ``replica_stop``: SIGSTOP a replica past its lease (1.5-3 leases), then SIGCONT; ends at SIGCONT.
- ``broker_stop``: SIGSTOP the broker 3-8 s; ends at SIGCONT.
- ``broker_reset``: every connection to the broker reset through the proxy, 1-3 times a second
  apart; ends at the last reset.
- ``catalog_kill``: SIGKILL the catalog's postmaster and backends, restart it 2-6 s later on the
  same data; ends when it takes connections again.

After each fault ends the nemesis waits for the first checkpoint to commit (``recovered_s``) and
for every replica to be ready with the run ``ok`` (``healthy_s``), then 8 s of quiet before the
next. Liveness: both within ``LIVENESS_BOUND_S`` (two leases and one checkpoint deadline) of the
fault's end. Safety (``Workload.verify``): every acknowledged event is in the log at the position
its append answered, and its episode in the manifest of every checkpoint asked after it was
acknowledged (each read as it committed; the last one after the schedule); every checkpoint ended
whole (a part and offsets per partition) or aborted with nothing left; no committed restore plan
gives an episode an attempt twice, nor an episode to two partitions' parts.

The broker SIGKILLed (Tansu keeps its log in memory: it comes back empty) is its own case
(``broker_lost``): the run must end ``stopped`` with ``503 run_lost`` on every replica, never
silently re-created (docs/design.md §12).

Every schedule is drawn from a seed, printed first, and replays from it
(``ROLLOUTLOG_NEMESIS_SEED``). ``soak`` runs a long one and returns its figures
(``benchmarks/soak.py``, ``make soak``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from rolloutlog.errors import RolloutlogError, UnknownRun
from rolloutlog.log import open_log, partition_for
from rolloutlog.trainer import AsyncTrainerClient
from rolloutlog.wire import CLIENT_KEEPALIVE_S
from tests import factories as f
from tests.api.conftest import TOKENS, wire
from tests.e2e._harness import (
    REPLICA_LEASE_S,
    Appends,
    CatalogView,
    Deployment,
    Replica,
    Replicas,
    kafka_log_url,
)
from tests.faults._kafka import FaultyKafka, faulty_kafka
from tests.faults._postgres import PostgresCluster, postgres_cluster

RUN = "nemesis"
PARTITIONS = 6
REPLICAS = 3
WRITERS = 6
CHECKPOINT_DEADLINE_S = 8.0
#: After a fault ends, a checkpoint commits and every replica is healthy within this bound: two
#: leases (the dead owner's lease runs out; the survivors' claim and rebuild) and one checkpoint
#: deadline (a checkpoint asked meanwhile ends, committed or aborted, and the next one commits).
LIVENESS_BOUND_S = 2 * REPLICA_LEASE_S + CHECKPOINT_DEADLINE_S
#: Past this, a fault's recovery is no longer waited for (the figure is reported as missing).
GIVE_UP_S = 60.0
QUIET_S = 8.0
RESTORE_EVERY = 12  # of the trainer's requests, one is a restore of the latest checkpoint
KINDS = ("replica_kill", "replica_stop", "broker_stop", "broker_reset", "catalog_kill")
SEED_VARIABLE = "ROLLOUTLOG_NEMESIS_SEED"


@dataclass
class Fault:
    """One fault of a schedule: what, on whom, for how long; then what became of it."""

    kind: str
    target: str
    hold_s: float
    resets: int = 0
    #: A replica restarted: from its spawn until it answered ``/healthz`` (the fault's end).
    restart_s: float | None = None
    began: float = 0.0
    ended: float = 0.0
    #: From the fault's end to the first checkpoint asked after it that committed (None: not
    #: within ``GIVE_UP_S``), to the first answered committed after it (maybe asked during the
    #: fault), and to every replica ready with the run ``ok``.
    recovered_s: float | None = None
    any_commit_s: float | None = None
    healthy_s: float | None = None
    unhealthy: str = ""
    #: The trainer's requests from the fault's start until its recovery (for the report).
    requests: list[str] = field(default_factory=list)

    def describe(self) -> str:
        what = f"{self.resets} resets" if self.kind == "broker_reset" else f"{self.hold_s:.1f} s"
        return f"{self.kind}({self.target}, {what})"


def schedule(seed: int, count: int | None = None, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of ``seed``: each of ``kinds`` once in a random order (``count`` None), or
    ``count`` faults of kinds drawn from them."""
    rng = random.Random(seed)
    if count is None:
        kinds = tuple(rng.sample(kinds, len(kinds)))
    else:
        kinds = tuple(rng.choice(kinds) for _ in range(count))
    faults = []
    for kind in kinds:
        replica = f"r{rng.randint(1, REPLICAS)}"
        if kind == "replica_kill":
            faults.append(Fault(kind, replica, round(rng.uniform(0.5, 7.0), 1)))
        elif kind == "replica_stop":
            faults.append(Fault(kind, replica, round(rng.uniform(1.5, 3.0) * REPLICA_LEASE_S, 1)))
        elif kind == "broker_stop":
            faults.append(Fault(kind, "broker", round(rng.uniform(3.0, 8.0), 1)))
        elif kind == "broker_reset":
            faults.append(Fault(kind, "broker", 0.0, resets=rng.randint(1, 3)))
        else:
            faults.append(Fault(kind, "catalog", round(rng.uniform(2.0, 6.0), 1)))
    return faults


def seed_from_env() -> int:
    """``ROLLOUTLOG_NEMESIS_SEED``, or a fresh one."""
    given = os.environ.get(SEED_VARIABLE)
    return int(given) if given else random.SystemRandom().randrange(1, 1 << 31)


# -- the world -------------------------------------------------------------------------------------


@dataclass
class World:
    kafka: FaultyKafka
    cluster: PostgresCluster
    deployment: Deployment
    replicas: Replicas

    @property
    def catalog(self) -> CatalogView:
        return self.replicas.catalog

    @property
    def log_url(self) -> str:
        return self.deployment.log_url or ""


async def _fresh_database(cluster: PostgresCluster) -> str:
    name = f"n_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(cluster.dsn)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return f"{cluster.url.rsplit('/', 1)[0]}/{name}?search_path=public"


@contextlib.asynccontextmanager
async def nemesis_world(workdir: Path) -> AsyncIterator[World]:
    """A private broker behind its proxy, a throwaway catalog, three replicas on both."""
    async with faulty_kafka() as kafka:
        with postgres_cluster() as cluster:
            log_url = f"{kafka_log_url(kafka.bootstrap)}&request_timeout_ms=10000"
            deployment = Deployment(
                "kafka+pg", workdir / "data", log_url, await _fresh_database(cluster)
            )
            replicas = Replicas(deployment, workdir, REPLICAS)
            try:
                await replicas.start()
                yield World(kafka, cluster, deployment, replicas)
            finally:
                if cluster.proc is not None and cluster.proc.poll() is not None:
                    with contextlib.suppress(RuntimeError):
                        cluster.start()  # the replicas' graceful stop wants their catalog
                if kafka.tansu.stopped:
                    kafka.tansu.resume()
                await asyncio.to_thread(replicas.stop)


# -- the workload ----------------------------------------------------------------------------------


@dataclass
class Asked:
    """One request of the trainer: a checkpoint or a restore, and how it ended."""

    what: str
    via: str
    sent: float
    answered: float = 0.0
    outcome: str = ""  # committed, aborted, pending, or the error's code
    ident: int | None = None
    message: str = ""
    #: A committed checkpoint's markers: partition -> offset.
    markers: dict[int, int] = field(default_factory=dict)


@dataclass
class Workload:
    world: World
    seed: int
    appends: Appends = field(init=False)
    clients: dict[str, AsyncTrainerClient] = field(default_factory=dict)
    asked: list[Asked] = field(default_factory=list)
    #: (asked, answered) times of committed checkpoints.
    commits: list[tuple[float, float]] = field(default_factory=list)
    manifests_read: int = 0
    manifests_unread: int = 0
    violations: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: (answer time, episode) of every acknowledged batch, in answer order.
    acked_episodes: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.appends = Appends(RUN)
        self.http = httpx.AsyncClient(
            timeout=5, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
        )

    @property
    def members(self) -> list[Replica]:
        return self.world.replicas.members

    async def setup(self) -> None:
        """Create the run, take its controller, register a participant per writer; until every
        replica owns some partitions."""
        # The trainer: one client given every replica's URL (in a seeded random order); it
        # stays on one until a transport error or a retriable refusal moves it to the next
        # (within the call's bound: a checkpoint's deadline + 10 s). And a client per replica,
        # for reads and for what one replica answers.
        urls = [r.url for r in self.members]
        random.Random(f"{self.seed}-urls").shuffle(urls)
        self.trainer_client = AsyncTrainerClient(
            urls, token=TOKENS["admin"], timeout_s=CHECKPOINT_DEADLINE_S + 12
        )
        for replica in self.members:
            self.clients[replica.url] = AsyncTrainerClient(
                replica.url, token=TOKENS["admin"], timeout_s=CHECKPOINT_DEADLINE_S + 12
            )
        first = self.clients[self.members[0].url]
        await first.create_run(RUN, partitions=PARTITIONS)
        epoch = await first.take_over(RUN)
        for client in [self.trainer_client, *self.clients.values()]:
            client.controller_epochs[RUN] = epoch
        self.epochs = [
            await first.register_participant(RUN, f"env-{i}", "environment") for i in range(WRITERS)
        ]
        await self.world.catalog.wait_owned(
            RUN, PARTITIONS, {r.replica_id for r in self.members}, timeout_s=60
        )

    async def writer(self, index: int) -> None:
        rng = random.Random(f"{self.seed}-writer-{index}")
        who = f.participant(pid=f"env-{index}", epoch=self.epochs[index])
        seq = 0
        number = 0
        while not self.stop.is_set():
            episode = f"w{index}-{number}"
            number += 1
            events = wire(
                f.started(episode, who=who, seq=seq + 1),
                f.step_started(episode, "seed", who=who, seq=seq + 2),
                f.boundary(episode, "seed", {"n": number}, who=who, seq=seq + 3),
                f.step_started(episode, "s1", who=who, seq=seq + 4),
            )
            seq += 4
            if await self.appends.post(rng.choice(self.members), events):
                self.acked_episodes.append((time.monotonic(), episode))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.2, 0.6)):
                    await self.stop.wait()

    def _acked_episodes(self, before: float) -> set[str]:
        """Episodes acknowledged before ``before``."""
        return {episode for at, episode in self.acked_episodes if at < before}

    async def trainer(self) -> None:
        rng = random.Random(f"{self.seed}-trainer")
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.5, 1.5)):
                    await self.stop.wait()
                    return
            if len(self.asked) % RESTORE_EVERY == RESTORE_EVERY - 1:
                await self.restore()
            else:
                await self.checkpoint()

    async def checkpoint(
        self, replica: Replica | None = None, deadline_s: float = CHECKPOINT_DEADLINE_S
    ) -> Asked:
        """A checkpoint asked by the trainer (``replica`` None) or through one replica only."""
        via = "trainer" if replica is None else replica.replica_id
        asked = Asked("checkpoint", via, time.monotonic())
        self.asked.append(asked)
        acked = self._acked_episodes(asked.sent)
        client = self.trainer_client if replica is None else self.clients[replica.url]
        try:
            info = await client.checkpoint(RUN, deadline_s=deadline_s, wait=True)
        except RolloutlogError as e:
            asked.outcome, asked.message = e.code, e.message[:300]
        except httpx.HTTPError as e:
            asked.outcome = type(e).__name__
        else:
            asked.outcome, asked.ident = info.status, info.checkpoint_id
            asked.markers = {int(o["partition"]): int(o["marker"]) for o in info.offsets}
        asked.answered = time.monotonic()
        if asked.outcome == "committed":
            self.commits.append((asked.sent, asked.answered))
            await self._check_manifest(asked, acked)
        return asked

    async def _check_manifest(self, asked: Asked, acked: set[str]) -> bool:
        """The committed checkpoint's manifest names every episode acknowledged before it was
        asked (read through a random replica; one trimmed by retention or not answered is
        counted unread)."""
        assert asked.ident is not None
        for replica in random.sample(self.members, len(self.members)):
            try:
                named = {
                    e["episode"] async for e in self.clients[replica.url].manifest(RUN, asked.ident)
                }
            except (RolloutlogError, httpx.HTTPError):
                continue
            self.manifests_read += 1
            missing = acked - named
            if missing:
                self.violations.append(self._describe_missing(asked, missing))
            return True
        self.manifests_unread += 1
        return False

    def _describe_missing(self, asked: Asked, missing: set[str]) -> str:
        """Where the acknowledged events of episodes a manifest misses are, against the
        checkpoint's markers, and what the trainer did before."""
        where = []
        for a in self.appends.acked:
            if a.event["episode"] in missing and a.event["type"] == "episode.started":
                marker = asked.markers.get(a.partition)
                where.append(
                    f"{a.event['episode']} at {a.partition}:{a.offset} (marker {marker}) via "
                    f"{a.via.rsplit(':', 1)[-1]}"
                )
        earlier = [
            f"{b.what} {b.ident} via {b.via}: {b.outcome}"
            for b in self.asked
            if b.sent < asked.sent and b.outcome == "committed"
        ][-4:]
        return (
            f"checkpoint {asked.ident} (via {asked.via}) misses {len(missing)} acknowledged "
            f"episodes: {sorted(where)[:8]}; before it: {earlier}"
        )

    async def restore(self) -> Asked:
        asked = Asked("restore", "trainer", time.monotonic())
        self.asked.append(asked)
        try:
            info = await self.trainer_client.restore(RUN)
        except RolloutlogError as e:
            asked.outcome, asked.message = e.code, e.message[:300]
        except httpx.HTTPError as e:
            asked.outcome = type(e).__name__
        else:
            asked.outcome, asked.ident = "committed", info.restore_id
        asked.answered = time.monotonic()
        return asked

    async def first_commit_after(
        self, after: float, until: float, asked_after: bool = True
    ) -> float | None:
        """Seconds from ``after`` to the first checkpoint asked after it (``asked_after``, or
        only answered after it) that committed (None by ``until``)."""
        while True:
            later = [
                answered
                for sent, answered in self.commits
                if answered >= after and (sent >= after or not asked_after)
            ]
            if later:
                return min(later) - after
            if time.monotonic() > until:
                return None
            await asyncio.sleep(0.1)

    async def health(self) -> str:
        """What keeps the replicas from being healthy ("" when every one is ready with the run
        ``ok``)."""
        problems = []
        for replica in self.members:
            try:
                ready = await self.http.get(f"{replica.url}/readyz")
                run = await self.http.get(
                    f"{replica.url}/v1/runs/{RUN}",
                    headers={"Authorization": f"Bearer {TOKENS['analyst']}"},
                )
            except httpx.HTTPError as e:
                problems.append(f"{replica.replica_id}: {type(e).__name__}")
                continue
            status = run.json().get("health", {}) if run.status_code == 200 else run.text[:200]
            if ready.status_code != 200 or not isinstance(status, dict) or status["status"] != "ok":
                problems.append(f"{replica.replica_id}: readyz {ready.status_code}, run {status}")
        return "; ".join(problems)

    async def healthy_after(self, after: float, until: float) -> tuple[float | None, str]:
        """Seconds from ``after`` until every replica is healthy (None by ``until``, with what
        was still wrong)."""
        while True:
            problems = await self.health()
            if not problems:
                return max(0.0, time.monotonic() - after), ""
            if time.monotonic() > until:
                return None, problems
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        for client in [self.trainer_client, *self.clients.values()]:
            await client.stop()
        await self.appends.close()
        await self.http.aclose()

    # -- the end: safety ------------------------------------------------------------------------

    async def settle(self) -> Asked:
        """After the schedule: the last checkpoint (the trainer asks again until
        one commits, within ``GIVE_UP_S``) must name every acknowledged episode."""
        deadline = time.monotonic() + GIVE_UP_S
        while True:
            last = await self.checkpoint(deadline_s=15)
            if last.outcome == "committed" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert last.outcome == "committed", f"no checkpoint committed after the schedule: {last}"
        read = self.manifests_read
        for _ in range(10):
            if self.manifests_read > read or await self._check_manifest(
                last, self._acked_episodes(last.sent)
            ):
                return last
            await asyncio.sleep(1.0)
        raise AssertionError(f"the last checkpoint's manifest could not be read: {last}")

    async def verify(self) -> None:
        """Every safety check over the whole run (see the module's docstring)."""
        assert not self.violations, self.violations
        await self.appends.check_log(self.world.log_url)
        catalog = self.world.catalog
        deadline = time.monotonic() + GIVE_UP_S
        while await catalog.fetch(
            "SELECT 1 FROM checkpoints WHERE run = $1 AND status = 'pending'", RUN
        ):
            assert time.monotonic() < deadline, "a checkpoint still pending a minute after"
            await asyncio.sleep(0.5)
        await check_checkpoints_whole(catalog)
        await check_restore_plans(catalog)

    def figures(self) -> dict[str, Any]:
        checkpoints = [a for a in self.asked if a.what == "checkpoint"]
        restores = [a for a in self.asked if a.what == "restore"]
        return {
            "appends": {
                "acknowledged": len(self.acked_episodes),
                "refused": len(self.appends.refused),
                "events_acknowledged": len(self.appends.acked),
            },
            "checkpoints": {
                "asked": len(checkpoints),
                "committed": sum(1 for a in checkpoints if a.outcome == "committed"),
                "outcomes": _count(a.outcome for a in checkpoints),
                "manifests_read": self.manifests_read,
                "manifests_unread": self.manifests_unread,
            },
            "restores": {
                "asked": len(restores),
                "committed": sum(1 for a in restores if a.outcome == "committed"),
                "outcomes": _count(a.outcome for a in restores),
            },
        }


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items()))


async def check_checkpoints_whole(catalog: CatalogView) -> None:
    """Every checkpoint committed (or since expired) has a part and offsets for every partition;
    every aborted one kept no part, no offsets and no manifest part."""
    rows = await catalog.fetch("SELECT checkpoint_id, status FROM checkpoints WHERE run = $1", RUN)
    every = set(range(PARTITIONS))
    for row in rows:
        checkpoint = await catalog.checkpoint(RUN, row["checkpoint_id"])
        where = f"checkpoint {row['checkpoint_id']}: {checkpoint}"
        if row["status"] in ("committed", "expired"):
            assert set(checkpoint["parts"]) == every, f"partial {where}"
            assert checkpoint["offset_partitions"] == every, f"partial {where}"
        else:
            assert row["status"] == "aborted", where
            assert not checkpoint["parts"], f"aborted with parts: {where}"
            assert not checkpoint["offset_partitions"], f"aborted with offsets: {where}"
            assert not checkpoint["manifest_partitions"], f"aborted with a manifest: {where}"


async def check_restore_plans(catalog: CatalogView) -> None:
    """No committed restore plan gives an episode an attempt twice: per episode, attempts
    increase strictly from restore to restore, each replacing the one the previous restore
    gave; an aborted request left no plan; the owners' parts plan each episode once, in its
    own partition."""
    committed = {
        r["restore_id"]
        for r in await catalog.fetch("SELECT restore_id FROM restores WHERE run = $1", RUN)
    }
    rows = await catalog.fetch(
        "SELECT restore_id, episode, previous_attempt, attempt FROM restore_episodes "
        "WHERE run = $1 ORDER BY restore_id",
        RUN,
    )
    last: dict[str, int] = {}
    for row in rows:
        episode, attempt = row["episode"], row["attempt"]
        assert row["restore_id"] in committed, f"a plan of restore {row['restore_id']} uncommitted"
        assert attempt > row["previous_attempt"], dict(row)
        assert attempt > last.get(episode, -1), (
            f"{episode}: attempt {attempt} planned again by restore {row['restore_id']}"
        )
        assert row["previous_attempt"] == last.get(episode, 0), (
            f"{episode}: restore {row['restore_id']} replaces attempt {row['previous_attempt']}, "
            f"the current one was {last.get(episode, 0)}"
        )
        last[episode] = attempt
    requests = await catalog.fetch(
        "SELECT restore_id, status FROM restore_requests WHERE run = $1", RUN
    )
    for request in requests:
        restore_id = request["restore_id"]
        if request["status"] == "aborted":
            assert restore_id not in committed, dict(request)
        if restore_id not in committed:
            continue
        parts = await catalog.fetch(
            "SELECT partition, entries FROM restore_parts WHERE run = $1 AND restore_id = $2",
            RUN,
            restore_id,
        )
        seen: dict[str, int] = {}
        for part in parts:
            # Each entry: [episode, previous_attempt, attempt, action, reason, cut, begun_after].
            for entry in json.loads(part["entries"])["episodes"]:
                name = entry[0]
                assert name not in seen, (
                    f"restore {restore_id}: {name} in the parts of partitions {seen[name]} "
                    f"and {part['partition']}"
                )
                seen[name] = part["partition"]
        # The requester plans the partitions it owns in-process and takes the others' parts
        # from these rows (a row of a partition it owns by then is a former owner's, unused):
        # each row plans episodes of its own partition only.
        for name, partition in seen.items():
            assert partition == partition_for(name, PARTITIONS), (restore_id, name, partition)


# -- the nemesis -----------------------------------------------------------------------------------


class Nemesis:
    """Inflicts a schedule's faults one at a time, measuring each one's recovery."""

    def __init__(self, world: World, workload: Workload) -> None:
        self.world = world
        self.workload = workload

    async def _serving(self, replica: Replica) -> None:
        """Until a restarted replica answers ``/healthz`` (it serves, maybe not ready yet)."""
        deadline = time.monotonic() + GIVE_UP_S
        while True:
            assert replica.proc is not None and replica.proc.poll() is None, replica.tail()
            with contextlib.suppress(httpx.HTTPError):
                if (await self.workload.http.get(f"{replica.url}/healthz")).status_code == 200:
                    return
            assert time.monotonic() < deadline, f"{replica.replica_id} did not serve again"
            await asyncio.sleep(0.05)

    async def inflict(self, fault: Fault) -> None:
        """Cause ``fault``; returns when it ended (``fault.ended``)."""
        world = self.world
        fault.began = time.monotonic()
        if fault.kind == "replica_kill":
            replica = world.replicas[fault.target]
            await asyncio.to_thread(replica.kill)
            await asyncio.sleep(fault.hold_s)
            replica.starts += 1
            replica.proc = replica._spawn()
            spawned = time.monotonic()
            await self._serving(replica)
            fault.restart_s = round(time.monotonic() - spawned, 2)
        elif fault.kind == "replica_stop":
            replica = world.replicas[fault.target]
            replica.pause()
            try:
                await asyncio.sleep(fault.hold_s)
            finally:
                replica.resume()
        elif fault.kind == "broker_stop":
            world.kafka.tansu.stall()
            try:
                await asyncio.sleep(fault.hold_s)
            finally:
                world.kafka.tansu.resume()
        elif fault.kind == "broker_reset":
            for index in range(fault.resets):
                if index:
                    await asyncio.sleep(1.0)
                world.kafka.proxy.reset_all()
        elif fault.kind == "catalog_kill":
            await asyncio.to_thread(world.cluster.kill)
            await asyncio.sleep(fault.hold_s)
            await asyncio.to_thread(world.cluster.start)
        else:
            raise AssertionError(f"no such fault: {fault.kind}")
        fault.ended = time.monotonic()

    async def recover(self, fault: Fault) -> None:
        """Until a checkpoint commits and every replica is healthy after ``fault`` (each within
        ``GIVE_UP_S``), then quiet."""
        until = fault.ended + GIVE_UP_S
        work = self.workload
        (
            fault.recovered_s,
            fault.any_commit_s,
            (fault.healthy_s, fault.unhealthy),
        ) = await asyncio.gather(
            work.first_commit_after(fault.ended, until),
            work.first_commit_after(fault.ended, until, asked_after=False),
            work.healthy_after(fault.ended, until),
        )
        recovered = fault.ended + (fault.recovered_s or GIVE_UP_S)
        fault.requests = [
            f"{a.what} via {a.via} at {a.sent - fault.ended:+.1f} s: {a.outcome or 'unanswered'}"
            + (f" in {a.answered - a.sent:.1f} s" if a.answered else "")
            + (f" ({a.message})" if a.message else "")
            for a in work.asked
            if fault.began <= a.sent <= recovered
        ]
        quiet_until = max(fault.ended + QUIET_S, time.monotonic() + 1.0)
        await asyncio.sleep(max(0.0, quiet_until - time.monotonic()))

    async def run(self, faults: list[Fault], say: Any = print) -> None:
        # Warm-up: the workload has a committed checkpoint before the first fault.
        start = time.monotonic()
        first = await self.workload.first_commit_after(start, start + GIVE_UP_S)
        assert first is not None, "no checkpoint committed before the first fault"
        await asyncio.sleep(2.0)
        for number, fault in enumerate(faults, 1):
            await self.inflict(fault)
            await self.recover(fault)
            say(
                f"nemesis: {number}/{len(faults)} {fault.describe()}: checkpoint "
                f"{_seconds(fault.recovered_s)} and healthy {_seconds(fault.healthy_s)} after "
                f"it ended{'; ' + fault.unhealthy if fault.unhealthy else ''}"
            )
            if not liveness_failures([fault]):
                continue
            for line in fault.requests:
                say(f"nemesis:   {line}")


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def liveness_failures(faults: list[Fault], bound_s: float = LIVENESS_BOUND_S) -> list[str]:
    """The faults after which no checkpoint committed, or some replica stayed unhealthy, within
    ``bound_s`` of their end."""
    failures = []
    for fault in faults:
        if fault.recovered_s is None or fault.recovered_s > bound_s:
            failures.append(f"{fault.describe()}: checkpoint {_seconds(fault.recovered_s)}")
        if fault.healthy_s is None or fault.healthy_s > bound_s:
            failures.append(
                f"{fault.describe()}: healthy {_seconds(fault.healthy_s)} ({fault.unhealthy})"
            )
    return failures


def fault_figures(faults: list[Fault]) -> dict[str, Any]:
    """Per fault kind: how many, and p50/max of the seconds to a checkpoint and to health."""
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        mine = [x for x in faults if x.kind == kind]
        if not mine:
            continue
        entry: dict[str, Any] = {"faults": len(mine)}
        for name in ("recovered_s", "any_commit_s", "healthy_s"):
            values = [getattr(x, name) for x in mine if getattr(x, name) is not None]
            entry[name] = {
                "p50": round(statistics.median(values), 2) if values else None,
                "max": round(max(values), 2) if values else None,
                "missing": len(mine) - len(values),
            }
        restarts = [x.restart_s for x in mine if x.restart_s is not None]
        if restarts:
            entry["restart_s"] = {
                "p50": round(statistics.median(restarts), 2),
                "max": round(max(restarts), 2),
            }
        by_kind[kind] = entry
    return by_kind


async def broker_lost(world: World, workload: Workload, timeout_s: float = 60.0) -> None:
    """The broker SIGKILLed and restarted empty: every replica reports the run ``stopped``;
    appends and checkpoints through each answer ``503 run_lost``; the run's topic is not
    re-created."""
    world.kafka.restart_empty()
    deadline = time.monotonic() + timeout_s
    pending = {r.replica_id for r in workload.members}
    while pending:
        for replica in workload.members:
            if replica.replica_id not in pending:
                continue
            with contextlib.suppress(httpx.HTTPError):
                run = await workload.http.get(
                    f"{replica.url}/v1/runs/{RUN}",
                    headers={"Authorization": f"Bearer {TOKENS['analyst']}"},
                )
                if run.status_code == 200 and run.json()["health"]["status"] == "stopped":
                    pending.discard(replica.replica_id)
        assert time.monotonic() < deadline, f"not stopped within {timeout_s} s: {sorted(pending)}"
        await asyncio.sleep(0.2)
    for replica in workload.members:
        episode = f"lost-{replica.replica_id}"
        who = f.participant(pid="env-0", epoch=workload.epochs[0])
        events = wire(f.started(episode, who=who, seq=1 << 19))
        assert not await workload.appends.post(replica, events), "acknowledged on a lost log"
        status, body = workload.appends.refused[-1][1:]
        assert status == 503 and '"run_lost"' in body, (replica.replica_id, status, body)
        asked = await workload.checkpoint(replica)
        assert asked.outcome == "run_lost", (replica.replica_id, asked)
    async with open_log(world.log_url) as log:
        try:
            partitions = await log.partitions(RUN)
        except UnknownRun:
            return
        raise AssertionError(f"the lost run's topic was re-created ({partitions} partitions)")


# -- the soak --------------------------------------------------------------------------------------


async def soak(
    minutes: float, seed: int, workdir: Path, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    """A long schedule (as many faults as fit in ``minutes``, ~15 s each); its figures."""
    count = max(1, int(minutes * 60 / 15))
    faults = schedule(seed, count, kinds)
    print(f"nemesis soak: seed {seed} ({SEED_VARIABLE}={seed}), {count} faults", flush=True)
    started = time.monotonic()
    async with nemesis_world(workdir) as world:
        workload = Workload(world, seed)
        try:
            await workload.setup()
            tasks = [asyncio.create_task(workload.writer(i)) for i in range(WRITERS)]
            tasks.append(asyncio.create_task(workload.trainer()))
            try:
                await Nemesis(world, workload).run(faults, lambda s: print(s, flush=True))
            finally:
                workload.stop.set()
                await asyncio.gather(*tasks)
            safety = ""
            try:
                await workload.settle()
                await workload.verify()
            except AssertionError as e:
                safety = str(e)[:2000]
        finally:
            await workload.close()
    failures = liveness_failures(faults)
    return {
        "seed": seed,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "replicas": REPLICAS,
        "lease_s": REPLICA_LEASE_S,
        "checkpoint_deadline_s": CHECKPOINT_DEADLINE_S,
        "liveness_bound_s": LIVENESS_BOUND_S,
        "liveness_failures": failures,
        "safety_failure": safety,
        **workload.figures(),
        "faults": fault_figures(faults),
        "schedule": [asdict(x) | {"began": None, "ended": None} for x in faults],
    }
