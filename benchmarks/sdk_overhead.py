"""CPU cost per recorded event on the participant's event loop (target: <= 20 us).

Concurrent episodes each record ``episode.started`` then boundaries with a small state, awaiting
every event until durable (the write-ahead rule), through:

- ``null``: the SDK's pipeline with a transport that acknowledges at once (builders, seq,
  budget, coalescing, futures; no I/O) — the SDK's own share;
- ``http``: ``HttpTransport`` to a real ``rolloutlog serve`` (embedded log) in a subprocess;
- ``kafka``: ``KafkaTransport`` to a Kafka-protocol broker (Tansu, or ``ROLLOUTLOG_BENCH_KAFKA``),
  registration through a real ``serve --log kafka://…``; every envelope checked (the SDK's own
  by their caller-supplied values); ``kafka-unchecked`` the same with ``validate=False``.

CPU is this process's user + system time (``getrusage``) over the recording phase (the service and the
broker run in other processes), divided by the events recorded. Each figure is the median of
``--runs`` runs, on uvloop (what a participant should run) and on asyncio's default loop. On a
shared machine the same code's CPU per event moves with the load (cache and core sharing; a tight
reference loop did not show it, the null pipeline does): compare transports with the ``null``
figure of the same run. Saved to ``benchmarks/results/sdk_overhead.json`` (``--quick``: one short run per case, saved to
``sdk_overhead_quick.json``, not committed).

    python benchmarks/sdk_overhead.py [--runs 3] [--events 20000] [--transports null,http,kafka]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any

from _common import ROOT, kafka_broker, save, serve_command, summary, wait_ready

from rolloutlog.log import Position
from rolloutlog.participants import Environment, HttpTransport, KafkaTransport, Transport
from rolloutlog.participants._encoding import encode_wire
from rolloutlog.participants._transport import _Pending
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import free_port

TOKENS = {"participant": "participant-token-0001", "trainer": "trainer-token-00000001"}
RUN = "bench"
EPISODES = 200


class NullTransport(Transport):
    """Acknowledges every batch at once: the SDK's own CPU, no I/O."""

    async def register(self, run: str, participant_id: str, kind: str) -> int:
        return 1

    def _encode(self, run: str, event: dict[str, Any]) -> bytes:
        return encode_wire(event)

    async def _send(self, run: str, items: Sequence[_Pending]) -> list[Position]:
        await asyncio.sleep(0)
        return [Position(0, i) for i in range(len(items))]


@contextlib.contextmanager
def server(log_url: str | None) -> Iterator[str]:
    data_dir = tempfile.mkdtemp(prefix="rolloutlog-sdk-bench-")
    tokens = os.path.join(data_dir, "tokens.json")
    with open(tokens, "w") as out:
        json.dump(TOKENS, out)
    port = free_port()
    extra = ["--log", log_url] if log_url else []
    proc = subprocess.Popen(
        serve_command(data_dir, port, "--tokens", tokens, *extra),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 30)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)


async def record(transport: Transport, run: str, events: int, tag: str) -> dict[str, float]:
    env = Environment(transport, run, f"env-{tag}")
    await env.register()
    per_episode = max(2, events // EPISODES)

    async def one(i: int | str) -> None:
        episode = await env.start_episode(f"{tag}-{i}", {"prompt": f"task {i}"})
        for turn in range(per_episode - 1):
            await episode.boundary("invoke_agent", {"turn": turn, "observation": "ok"})

    # Warm up (lazy imports, connection pools, the server's caches) outside the measurement.
    await asyncio.gather(*(one(f"warm{i}") for i in range(EPISODES // 10)))
    gc.collect()
    requests = transport.stats.requests
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(EPISODES)))
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    recorded = EPISODES * per_episode
    return {
        "cpu_us_per_event": (user + system) / recorded * 1e6,
        "user_us_per_event": user / recorded * 1e6,
        "system_us_per_event": system / recorded * 1e6,
        "events_per_s": recorded / wall,
        "events_per_request": recorded / max(1, transport.stats.requests - requests),
    }


async def measure(name: str, runs: int, events: int) -> dict[str, Any]:
    samples: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        if name == "null":
            for run in range(runs):
                async with NullTransport() as transport:
                    samples.append(await record(transport, RUN, events, f"r{run}"))
        else:
            bootstrap = stack.enter_context(kafka_broker()) if name.startswith("kafka") else None
            log_url = f"kafka://{bootstrap}" if bootstrap else None
            url = stack.enter_context(server(log_url))
            async with AsyncTrainerClient(url, token=TOKENS["trainer"]) as trainer:
                await trainer.create_run(RUN, partitions=16)
            for run in range(runs):
                transport: Transport
                if name == "http":
                    transport = HttpTransport(url, token=TOKENS["participant"])
                else:
                    transport = KafkaTransport(
                        str(log_url),
                        url=url,
                        token=TOKENS["participant"],
                        validate=name != "kafka-unchecked",
                    )
                async with transport:
                    samples.append(await record(transport, RUN, events, f"r{run}"))
    return {key: summary([s[key] for s in samples]) for key in samples[0]}


def run_with(loop: str, coroutine: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--transports", default="null,http,kafka,kafka-unchecked")
    parser.add_argument("--loops", default="uvloop,asyncio")
    parser.add_argument("--quick", action="store_true", help="1 run of 5,000 events per case")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.events = 1, 5_000
    results: dict[str, Any] = {}
    for loop in args.loops.split(","):
        for name in args.transports.split(","):
            key = f"{name}/{loop}"
            results[key] = run_with(loop, measure(name, args.runs, args.events))
            cpu = results[key]["cpu_us_per_event"]["median"]
            rate = results[key]["events_per_s"]["median"]
            print(f"{key:24s} {cpu:7.1f} us CPU/event  {rate:9.0f} events/s")
    path = save(
        "sdk_overhead_quick" if args.quick else "sdk_overhead",
        {
            "target_cpu_us_per_event": 20,
            "episodes": EPISODES,
            "events_per_run": args.events,
            "headline": "uvloop (the figures per transport are also given on asyncio's loop)",
            "load_average": os.getloadavg(),
            "results": results,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
