"""Replicas: S1 on 1, 2 and 3 replicas of ``rolloutlog serve`` sharing one Kafka (Tansu) log and
one PostgreSQL catalog.

Per replica count (a fresh topic prefix and catalog schema each; ``--lease-s`` as given):

- ``fold_cpu_s``: each replica's CPU seconds (``/proc/PID/stat`` utime + stime) from before S1's
  episodes are appended (straight to Kafka with the SDK's ``KafkaTransport``, from this process)
  until every partition's owner has folded its partition to the log's end (its
  ``GET …/projector`` ``applied`` >= ``end_offset``); the fold is split by partition, so each
  replica's share should be ~1/N of one replica's. ``idle_cpu_s_per_s``: what the replica spends
  idle (measured over ``IDLE_S`` before the load); ``fold_cpu_s_above_idle`` subtracts it over
  the load's duration;
- ``checkpoint_s``: request → committed, requested from each replica in turn (manifest parts
  by every owner, committed by the last);
- ``restore_s`` and ``restore_and_fetch_s``: a restore requested from one replica, its
  projections streamed from the next;
- ``failover`` (N >= 2): SIGKILL of the last replica → every partition owned again by the
  survivors (``partition_leases``) → the next checkpoint committed (requested from a survivor,
  retried while refused with a retriable error).

S1 is reduced (``--episodes``, default 4,000 live rollouts instead of 16,000: three replicas
and the load generator share this machine's two cores); the figure says so.

``membership`` (its own cluster of up to three replicas, S1's rollouts appended first, so that
every change of hands refolds for real): per membership change — a replica joins two, one leaves
(SIGTERM), one is SIGKILLed, the killed one restarts under its id — ``partitions_moved`` (leases
whose owner changed) against ``minimal_moves`` (what any balanced assignment must move) and
``round_robin_moves`` (what the previous rule, round robin over the sorted live ids, moves for
the same change: the baseline), and the seconds until every partition is owned by the new
members, until every replica's ``GET /v1/runs/{run}`` says nothing holds the run back
(``healthy_again_s``), and (after the SIGKILL) until a checkpoint commits. ``busy_replica``: one
replica's event loop kept busy for four leases (``ROLLOUTLOG_TEST_HOOKS``' block-loop route):
partitions moved (none: the heartbeat has its own thread) and how long until the others name it.

    python benchmarks/replicas.py [--episodes 4000] [--runs 3] [--counts 1,2,3] [--lease-s 6]
        [--parts scaling,membership]

Saved to ``benchmarks/results/replicas.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT, kafka_broker, save, serve_command, summary
from suite_service import PARTITIONS, POSTGRES, postgres_execute, sdk_load
from workloads import Workload, s1

from rolloutlog.errors import RolloutlogError
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import free_port

RUN = "s1"
#: Seconds of idleness over which a replica's background CPU is measured.
IDLE_S = 5.0
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Deployment:
    """What ``suite_service.sdk_load`` needs of a deployment: the Kafka log's URL."""

    kafka: str
    prefix: str = field(default_factory=lambda: f"r{uuid.uuid4().hex[:8]}.")

    @property
    def log_url(self) -> str:
        return f"kafka://{self.kafka}?topic_prefix={self.prefix}"


class Replica:
    """One ``serve --replica-id ID --lease-s S`` subprocess with a data directory of its own."""

    def __init__(self, replica_id: str, data_dir: Path, log_url: str, catalog: str, lease_s: float):
        self.replica_id = replica_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir / replica_id
        extra = ["--log", log_url, "--catalog", catalog, "--replica-id", replica_id]
        self.command = serve_command(self.data_dir, self.port, *extra, "--lease-s", str(lease_s))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "serve.log").open("ab") as errors:
            self.proc = subprocess.Popen(
                self.command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors
            )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"replica {self.replica_id} exited: {self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self) -> str:
        path = self.data_dir / "serve.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Cluster:
    """N replicas on one topic prefix and one catalog schema (both fresh)."""

    def __init__(self, kafka: str, count: int, lease_s: float) -> None:
        self.deployment = Deployment(kafka)
        self.schema = f"bench_{uuid.uuid4().hex[:12]}"
        postgres_execute(f'CREATE SCHEMA "{self.schema}"')
        catalog = f"{POSTGRES}{'&' if '?' in POSTGRES else '?'}search_path={self.schema}"
        self.tmp = Path(tempfile.mkdtemp(prefix="rolloutlog-replicas-"))
        self.replicas = [
            Replica(f"r{i}", self.tmp, self.deployment.log_url, catalog, lease_s)
            for i in range(1, count + 1)
        ]

    @property
    def url(self) -> str:
        """Where ``sdk_load`` registers the participants: the first replica."""
        return self.replicas[0].url

    def start(self) -> None:
        self.replicas[0].start()  # the first one migrates the fresh schema
        self._ready(self.replicas[:1])
        for replica in self.replicas[1:]:
            replica.start()
        self._ready(self.replicas[1:])

    @staticmethod
    def _ready(replicas: list[Replica]) -> None:
        deadline = time.monotonic() + 120
        while not all(r.ready() for r in replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not become ready")
            time.sleep(0.1)

    def print_logs(self) -> None:
        """Every replica's last log lines, on stderr (when a measurement failed)."""
        for replica in self.replicas:
            print(f"--- {replica.replica_id}\n{replica.log_tail()}", file=sys.stderr)

    def remove(self) -> None:
        for replica in self.replicas:
            replica.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        postgres_execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    async def leases(self) -> dict[int, str | None]:
        import asyncpg

        dsn = POSTGRES.split("?")[0].replace("postgresql+asyncpg", "postgresql")
        conn = await asyncpg.connect(dsn, server_settings={"search_path": self.schema})
        try:
            rows = await conn.fetch(
                "SELECT partition, replica_id FROM partition_leases WHERE run = $1", RUN
            )
        finally:
            await conn.close()
        return {row["partition"]: row["replica_id"] for row in rows}

    async def owned_by(self, live: set[str], timeout_s: float = 120, every: bool = False) -> float:
        """Seconds until every partition is owned by a replica of ``live`` (``every``: and each
        of them owns some)."""
        t0 = time.perf_counter()
        while True:
            leases = await self.leases()
            owners = set(leases.values())
            if len(leases) == PARTITIONS and (owners == live if every else owners <= live):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"partitions not owned by {sorted(live)}: {leases}")
            await asyncio.sleep(0.02)

    async def folded(self, timeout_s: float = 600) -> float:
        """Seconds until each partition's owner has applied it to the log's end."""
        t0 = time.perf_counter()
        urls = {r.replica_id: r.url for r in self.replicas if r.proc and r.proc.poll() is None}
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                leases = await self.leases()
                lags = {}
                for replica_id, url in urls.items():
                    response = await client.get(f"{url}/v1/runs/{RUN}/projector")
                    response.raise_for_status()
                    lags[replica_id] = {
                        p["partition"]: p["end_offset"] - p["applied"]
                        for p in response.json()["partitions"]
                    }
                behind = [p for p, owner in leases.items() if lags.get(str(owner), {}).get(p, 1)]
                if len(leases) == PARTITIONS and not behind:
                    return time.perf_counter() - t0
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"partitions {behind} not folded by their owners")
                await asyncio.sleep(0.1)


class Retries:
    """Calls asked again while refused with a retriable error (as a trainer does), counted."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, call: Any, timeout_s: float = 120) -> Any:
        t0 = time.perf_counter()
        while True:
            try:
                return await call()
            except (RolloutlogError, httpx.TransportError) as e:
                retriable = not isinstance(e, RolloutlogError) or e.retriable
                if not retriable or time.perf_counter() - t0 > timeout_s:
                    raise
                self.count += 1
            await asyncio.sleep(0.05)


async def measure(cluster: Cluster, workload: Workload, runs: int) -> dict[str, Any]:
    replicas = cluster.replicas
    clients = [AsyncTrainerClient(r.url, timeout_s=300) for r in replicas]
    try:
        await clients[0].create_run(RUN, partitions=PARTITIONS)
        epoch = await clients[0].take_over(RUN)
        for client in clients:
            client.controller_epochs[RUN] = epoch
        await cluster.owned_by({r.replica_id for r in replicas})

        # What an idle replica spends (heartbeats, the restore poller, the checkpoint sweep): the
        # fold's share is what the load adds to it.
        idle_before = [r.cpu_s() for r in replicas]
        await asyncio.sleep(IDLE_S)
        idle_rate = [
            (r.cpu_s() - before) / IDLE_S for r, before in zip(replicas, idle_before, strict=True)
        ]
        cpu_before = [r.cpu_s() for r in replicas]
        t0 = time.perf_counter()
        _, load_s = await sdk_load(cluster, RUN, workload)
        await cluster.folded()
        fold_s = time.perf_counter() - t0
        fold_cpu = [r.cpu_s() - before for r, before in zip(replicas, cpu_before, strict=True)]
        owned = await cluster.leases()

        checkpoint_s, restore_s, fetch_s = [], [], []
        retrying = Retries()
        restore_counts: list[dict[str, int]] = []
        restarts: list[dict[str, Any]] = []
        cold = await retrying(lambda: clients[0].checkpoint(RUN))
        assert cold.status == "committed", cold
        for index in range(runs):
            client = clients[index % len(clients)]
            t0 = time.perf_counter()
            info = await retrying(lambda: client.checkpoint(RUN))  # noqa: B023 - awaited here
            checkpoint_s.append(time.perf_counter() - t0)
            assert info.status == "committed" and info.counts["continue"] >= workload.live, info
        for index in range(runs):
            requester, fetcher = clients[index % len(clients)], clients[(index + 1) % len(clients)]
            if index:
                again = await retrying(lambda: requester.checkpoint(RUN))  # noqa: B023
                assert again.status == "committed", again
                if again.counts["restart"]:  # every rollout is live: a restart needs a reason
                    restarts.append(await restart_reasons(requester, again.checkpoint_id))
            t0 = time.perf_counter()
            restored = await retrying(lambda: requester.restore(RUN))  # noqa: B023
            restore_s.append(time.perf_counter() - t0)
            fetched = 0
            async for _ in fetcher.projections(RUN, restored.restore_id):
                fetched += 1
            fetch_s.append(time.perf_counter() - t0)
            restore_counts.append(dict(restored.counts))
            assert fetched == restored.counts["continue"], (fetched, restored.counts)

        out: dict[str, Any] = {
            "replicas": len(replicas),
            "partitions_owned": {
                r.replica_id: sum(owner == r.replica_id for owner in owned.values())
                for r in replicas
            },
            "load_s": load_s,
            "load_and_fold_s": fold_s,
            "fold_cpu_s": {r.replica_id: cpu for r, cpu in zip(replicas, fold_cpu, strict=True)},
            "fold_cpu_s_max": max(fold_cpu),
            "fold_cpu_s_total": sum(fold_cpu),
            "idle_cpu_s_per_s": {
                r.replica_id: rate for r, rate in zip(replicas, idle_rate, strict=True)
            },
            "fold_cpu_s_above_idle": {
                r.replica_id: cpu - rate * fold_s
                for r, cpu, rate in zip(replicas, fold_cpu, idle_rate, strict=True)
            },
            "checkpoint_s": summary(checkpoint_s),
            "restore_s": summary(restore_s),
            "restore_and_fetch_s": summary(fetch_s),
            "restore_counts": restore_counts,
            "unexpected_restarts": restarts,
        }
        if len(replicas) > 1:
            out["failover"] = await failover(cluster, clients, workload, retrying)
        # Timed calls include their retries: a retriable refusal (e.g. a projector catching up
        # after a restore when a checkpoint's markers arrived) is asked again, as a trainer does.
        out["retriable_refusals"] = retrying.count
        return out
    finally:
        for client in clients:
            await client.stop()


async def restart_reasons(client: AsyncTrainerClient, checkpoint_id: int) -> dict[str, Any]:
    """How many entries of a checkpoint's manifest restart, and why (the first reasons)."""
    reasons: dict[str, int] = {}
    async for entry in client.manifest(RUN, checkpoint_id):
        if entry["action"] == "restart":
            reason = str(entry.get("reason"))
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"checkpoint_id": checkpoint_id, "reasons": dict(list(reasons.items())[:5])}


async def failover(
    cluster: Cluster, clients: list[AsyncTrainerClient], workload: Workload, retrying: Retries
) -> dict[str, float]:
    """SIGKILL the last replica; time until its partitions are owned again, and until a
    checkpoint requested from a survivor commits."""
    victim, survivors = cluster.replicas[-1], cluster.replicas[:-1]
    victim.kill()
    t0 = time.perf_counter()
    owned_s = await cluster.owned_by({r.replica_id for r in survivors})
    info = await retrying(lambda: clients[0].checkpoint(RUN, deadline_s=30))
    committed_s = time.perf_counter() - t0
    assert info.status == "committed" and info.counts["continue"] >= workload.live, info
    return {"owned_again_s": owned_s, "next_checkpoint_committed_s": committed_s}


def round_robin(partitions: int, live: list[str]) -> dict[int, str]:
    """The previous assignment rule (the baseline): round robin over the sorted live ids, offset
    per run by a stable hash of its name."""
    ids = sorted(live)
    return {p: ids[(zlib.crc32(RUN.encode()) + p) % len(ids)] for p in range(partitions)}


def minimal_moves(before: dict[int, str | None], live: list[str]) -> int:
    """The fewest leases any balanced assignment of ``live`` must move from ``before``."""
    base, extra = divmod(PARTITIONS, len(live))
    counts = [sum(1 for owner in before.values() if owner == r) for r in live]
    orphans = sum(1 for p in range(PARTITIONS) if before.get(p) not in live)
    above = sorted((c - base for c in counts if c > base), reverse=True)
    return orphans + sum(above) - min(extra, len(above))


async def healthy(cluster: Cluster, members: list[Replica], timeout_s: float = 300) -> float:
    """Seconds until every member's ``GET /v1/runs/{run}`` says nothing holds the run back."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            views = []
            for replica in members:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{replica.url}/v1/runs/{RUN}")
                    views.append(response.json()["health"])
            if len(views) == len(members) and all(
                v["status"] == "ok" and not v["held_back"] for v in views
            ):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"the run is still held back: {views}")
            await asyncio.sleep(0.05)


async def membership(kafka: str, lease_s: float, workload: Workload) -> dict[str, Any]:
    """Membership changes on a loaded run (see the module): moves and seconds per change."""
    cluster = Cluster(kafka, 3, lease_s)
    r1, r2, r3 = cluster.replicas
    changes: dict[str, Any] = {}
    try:
        r1.start()
        cluster._ready([r1])
        r2.start()
        cluster._ready([r2])
        client = AsyncTrainerClient(r1.url, timeout_s=300)
        try:
            await client.create_run(RUN, partitions=PARTITIONS)
            client.controller_epochs[RUN] = await client.take_over(RUN)
            await cluster.owned_by({"r1", "r2"})
            await sdk_load(cluster, RUN, workload)
            await cluster.folded()
            await healthy(cluster, [r1, r2])
            retrying = Retries()

            async def change(name: str, act: Any, members: list[Replica]) -> None:
                before = await cluster.leases()
                live = [r.replica_id for r in members]
                t0 = time.perf_counter()
                ready_s = await act()
                if ready_s is not None:  # a started process: timed from when it answers
                    t0 = time.perf_counter()
                # A join is done once the newcomer took its share (every member owns some).
                await cluster.owned_by(set(live), every=name == "join")
                owned_s = time.perf_counter() - t0
                healthy_s = owned_s + await healthy(cluster, members)
                after = await cluster.leases()
                old = {p: str(o) for p, o in before.items() if o is not None}
                changes[name] = {
                    "members": live,
                    "partitions_moved": sum(1 for p in range(PARTITIONS) if after[p] != before[p]),
                    "minimal_moves": minimal_moves(before, live),
                    "round_robin_moves": sum(
                        1
                        for p, owner in round_robin(PARTITIONS, live).items()
                        if owner != round_robin(PARTITIONS, sorted(set(old.values())))[p]
                    ),
                    "owned_again_s": owned_s,
                    "healthy_again_s": healthy_s,
                }
                if ready_s is not None:
                    changes[name]["process_ready_s"] = ready_s
                if name == "sigkill":
                    info = await retrying(lambda: client.checkpoint(RUN, deadline_s=30))
                    assert info.status == "committed", info
                    changes[name]["next_checkpoint_committed_s"] = time.perf_counter() - t0

            async def started(replica: Replica) -> float:
                t0 = time.perf_counter()
                replica.start()
                await asyncio.to_thread(cluster._ready, [replica])
                return time.perf_counter() - t0

            async def join() -> float:
                return await started(r3)

            async def leave() -> None:
                await asyncio.to_thread(r3.stop)

            async def kill() -> None:
                r2.kill()

            async def restart() -> float:
                return await started(r2)

            await change("join", join, [r1, r2, r3])
            await change("sigterm", leave, [r1, r2])
            await change("sigkill", kill, [r1])
            await change("restart", restart, [r1, r2])
            changes["busy_replica"] = await busy(cluster, r2, [r1], lease_s)
        finally:
            await client.stop()
    except BaseException:
        cluster.print_logs()
        raise
    finally:
        cluster.remove()
    return changes


async def busy(
    cluster: Cluster, victim: Replica, others: list[Replica], lease_s: float
) -> dict[str, Any]:
    """``victim``'s event loop kept busy for four leases: leases moved, and how long until every
    other replica names it in ``GET /v1/runs/{run}``."""
    before = await cluster.leases()
    blocked_s = 4 * lease_s
    async with httpx.AsyncClient(timeout=60) as client:
        block = asyncio.create_task(
            client.post(f"{victim.url}/_test/block-loop", params={"seconds": blocked_s})
        )
        t0 = time.perf_counter()
        named: dict[str, float] = {}
        while not block.done():
            for other in others:
                health = (await client.get(f"{other.url}/v1/runs/{RUN}")).json()["health"]
                if any(b["replica"] == victim.replica_id for b in health["held_back"]):
                    named.setdefault(other.replica_id, time.perf_counter() - t0)
            await asyncio.sleep(0.05)
        (await block).raise_for_status()
    after = await cluster.leases()
    return {
        "blocked_s": blocked_s,
        "partitions_moved": sum(1 for p in range(PARTITIONS) if after.get(p) != before.get(p)),
        "named_by_others_s": named,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4000, help="S1's live rollouts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--counts", default="1,2,3", help="replica counts to measure")
    parser.add_argument("--lease-s", type=float, default=6.0, help="the service default")
    parser.add_argument("--parts", default="scaling,membership", help="what to measure")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    os.environ["ROLLOUTLOG_TEST_HOOKS"] = "1"  # the busy replica's block-loop route
    for name in ("aiokafka", "rolloutlog.log.kafka"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workload = s1(args.episodes)
    results: dict[str, Any] = {
        "workload": f"S1 reduced to {args.episodes} live rollouts (the suite's S1: 16,000)",
        "partitions": PARTITIONS,
        "lease_s": args.lease_s,
        "runs": args.runs,
        "by_replicas": {},
    }
    with kafka_broker() as kafka:
        assert kafka is not None
        if "membership" in parts:
            print("membership changes on 3 replicas", file=sys.stderr, flush=True)
            results["membership"] = asyncio.run(membership(kafka, args.lease_s, workload))
            save("replicas", results)
        for count in (int(c) for c in args.counts.split(",") if "scaling" in parts):
            print(f"S1 on {count} replica(s)", file=sys.stderr, flush=True)
            cluster = Cluster(kafka, count, args.lease_s)
            try:
                cluster.start()
                figures = asyncio.run(measure(cluster, workload, args.runs))
            except BaseException:
                cluster.print_logs()
                raise
            finally:
                cluster.remove()
            results["by_replicas"][str(count)] = figures
            save("replicas", results)  # what is measured so far survives a later failure
    one = results["by_replicas"].get("1")
    if one:
        results["fold_cpu_share_of_one_replica"] = {
            n: max(figures["fold_cpu_s_above_idle"].values())
            / max(one["fold_cpu_s_above_idle"].values())
            for n, figures in results["by_replicas"].items()
        }
    print(save("replicas", results), file=sys.stderr)


if __name__ == "__main__":
    main()
