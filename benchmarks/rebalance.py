"""Replicas: how fast partitions change hands on Tansu, Kafka consumer groups against the catalog
leases rolloutlog's replicas use (docs/design.md §2).

- Consumer groups (aiokafka): three members of one group on a 16-partition topic, each a
  subprocess printing its assignments. ``join_s``: start → the three hold every partition
  between them; ``leave_s``: one member stops cleanly (SIGTERM: ``consumer.stop()`` sends
  LeaveGroup) → the two others hold every partition; ``killed_s``: one member is SIGKILLed (no
  LeaveGroup: the coordinator waits out its session) → the two others hold every partition.
  With aiokafka's default session (10 s, heartbeat 3 s) and a short one.
- Catalog leases: three ``rolloutlog serve`` replicas (``--lease-s`` default 6 and a short
  2), one run of 16 partitions. ``join_s``: the third replica started → every partition owned
  (``partition_leases``) with it among the owners; ``leave_s``: one replica SIGTERMed → the two
  others own every partition; ``killed_s``: one SIGKILLed → the same.

    python benchmarks/rebalance.py [--runs 1] [--parts groups,leases]

Saved to ``benchmarks/results/rebalance.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from _common import RESULTS, ROOT, kafka_broker, save, summary
from replicas import RUN, Cluster
from suite_service import PARTITIONS

from rolloutlog.trainer import AsyncTrainerClient

GROUP_CONFIGS = {
    "default": {"session_timeout_ms": 10_000, "heartbeat_interval_ms": 3_000},
    "short": {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000},
}
LEASES = {"default": 6.0, "short": 2.0}


# -- one consumer-group member (a subprocess) ------------------------------------------------------


async def member(bootstrap: str, topic: str, group: str, config: dict[str, int]) -> None:
    """Consume ``topic`` in ``group``; print ``{"t", "assigned"}`` at every assignment; stop
    cleanly (LeaveGroup) on SIGTERM."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.abc import ConsumerRebalanceListener

    class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            print(json.dumps({"t": time.time(), "assigned": None}), flush=True)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            partitions = sorted(tp.partition for tp in assigned)
            print(json.dumps({"t": time.time(), "assigned": partitions}), flush=True)

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, **config)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    consumer.subscribe([topic], listener=Listener())
    await consumer.start()
    try:
        while not stop.is_set():
            await consumer.getmany(timeout_ms=100)
    finally:
        await consumer.stop()


class Members:
    """Group members as subprocesses; ``latest`` is each one's latest assignment."""

    def __init__(self, bootstrap: str, topic: str, config: dict[str, int]) -> None:
        self.args = [bootstrap, topic, f"g{uuid.uuid4().hex[:8]}", json.dumps(config)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.latest: dict[int, tuple[float, list[int] | None]] = {}
        self.selector = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}

    def start(self, index: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--member", *self.args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self.selector.register(proc.stdout, selectors.EVENT_READ, index)
        self.procs[index] = proc
        self.latest.pop(index, None)
        self.partial.pop(index, None)

    def remove(self, index: int, signum: int) -> float:
        """Signal a member; returns when."""
        proc = self.procs.pop(index)
        assert proc.stdout is not None
        self.selector.unregister(proc.stdout)
        at = time.time()
        proc.send_signal(signum)
        self.latest.pop(index, None)
        proc.wait(timeout=60)
        return at

    def _read(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(timeout_s):
            data = self.partial.pop(key.data, b"") + (key.fileobj.read() or b"")  # type: ignore[union-attr]
            *lines, self.partial[key.data] = data.split(b"\n")
            for line in lines:
                if line.startswith(b'{"t"'):  # anything else a library printed is skipped
                    event = json.loads(line)
                    self.latest[key.data] = (event["t"], event["assigned"])

    def covered_after(self, since: float, timeout_s: float = 120) -> float:
        """Seconds from ``since`` until the live members hold every partition, each exactly
        once, by assignments made after ``since``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._read(0.05)
            held = [self.latest.get(i) for i in self.procs]
            if all(h is not None and h[1] is not None and h[0] >= since for h in held):
                partitions = sorted(p for h in held for p in h[1])  # type: ignore[union-attr]
                if partitions == list(range(PARTITIONS)):
                    return max(h[0] for h in held) - since  # type: ignore[union-attr]
        raise RuntimeError(f"the group never covered the topic: {self.latest}")

    def stop(self) -> None:
        for index in list(self.procs):
            self.remove(index, signal.SIGTERM)


async def create_topic(bootstrap: str) -> str:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = f"rebalance-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    return topic


def consumer_group(bootstrap: str, config: dict[str, int]) -> dict[str, float]:
    topic = asyncio.run(create_topic(bootstrap))
    members = Members(bootstrap, topic, config)
    try:
        began = time.time()
        for index in range(3):
            members.start(index)
        join_s = members.covered_after(began)
        leave_s = members.covered_after(members.remove(2, signal.SIGTERM))
        members.start(2)
        members.covered_after(time.time())
        killed_s = members.covered_after(members.remove(2, signal.SIGKILL))
    finally:
        members.stop()
    return {"join_s": join_s, "leave_s": leave_s, "killed_s": killed_s}


# -- catalog leases ------------------------------------------------------------------------------


async def catalog_leases(kafka: str, lease_s: float) -> dict[str, float]:
    cluster = Cluster(kafka, 3, lease_s)
    first, second, third = cluster.replicas
    try:
        cluster.replicas = [first, second]
        cluster.start()
        async with AsyncTrainerClient(first.url) as client:
            await client.create_run(RUN, partitions=PARTITIONS)
        await cluster.owned_by({"r1", "r2"})
        began = time.perf_counter()
        third.start()
        cluster.replicas = [first, second, third]
        join_s = await owned_with(cluster, {"r1", "r2", "r3"}, began)
        assert third.proc is not None
        began = time.perf_counter()
        third.proc.send_signal(signal.SIGTERM)  # a graceful stop, waited for by the poll below
        await cluster.owned_by({"r1", "r2"})
        leave_s = time.perf_counter() - began
        third.stop()
        third.start()
        await owned_with(cluster, {"r1", "r2", "r3"}, time.perf_counter())
        third.kill()
        began = time.perf_counter()
        await cluster.owned_by({"r1", "r2"})
        killed_s = time.perf_counter() - began
    finally:
        cluster.replicas = [first, second, third]
        cluster.remove()
    return {"join_s": join_s, "leave_s": leave_s, "killed_s": killed_s}


async def owned_with(cluster: Cluster, live: set[str], began: float) -> float:
    """Seconds from ``began`` until every partition is owned and every replica of ``live``
    owns some."""
    while True:
        leases = await cluster.leases()
        if len(leases) == PARTITIONS and set(leases.values()) == live:
            return time.perf_counter() - began
        if time.perf_counter() - began > 120:
            raise RuntimeError(f"partitions not spread over {sorted(live)}: {leases}")
        await asyncio.sleep(0.02)


def main() -> None:
    if sys.argv[1:2] == ["--member"]:
        bootstrap, topic, group, config = sys.argv[2:6]
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        asyncio.run(member(bootstrap, topic, group, json.loads(config)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--parts", default="groups,leases")
    args = parser.parse_args()
    parts = args.parts.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {"partitions": PARTITIONS, "runs": args.runs}
    with kafka_broker() as kafka:
        assert kafka is not None
        groups: dict[str, Any] = {}
        for name, config in GROUP_CONFIGS.items() if "groups" in parts else ():
            print(f"consumer group, {name} session", file=sys.stderr, flush=True)
            rounds = [consumer_group(kafka, config) for _ in range(args.runs)]
            groups[name] = {"config": config, **_summaries(rounds)}
        leases: dict[str, Any] = {}
        for name, lease_s in LEASES.items() if "leases" in parts else ():
            print(f"catalog leases, {name} lease ({lease_s} s)", file=sys.stderr, flush=True)
            rounds = [asyncio.run(catalog_leases(kafka, lease_s)) for _ in range(args.runs)]
            leases[name] = {"lease_s": lease_s, **_summaries(rounds)}
    results["consumer_groups"] = groups
    results["catalog_leases"] = leases
    previous = RESULTS / "rebalance.json"
    if previous.exists():  # a part not run this time keeps its earlier figures
        earlier = json.loads(previous.read_text())
        for part, key in (("groups", "consumer_groups"), ("leases", "catalog_leases")):
            if part not in parts and key in earlier:
                results[key] = earlier[key]
    print(save("rebalance", results), file=sys.stderr)


def _summaries(rounds: list[dict[str, float]]) -> dict[str, Any]:
    return {key: summary([r[key] for r in rounds]) for key in rounds[0]}


if __name__ == "__main__":
    main()
