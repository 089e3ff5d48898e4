"""Benchmark: a normal client's appends and health checks against a real ``rolloutlog serve``
(embedded) while slow clients hold its edges.

- ``quiet``: nobody else; the reference.
- ``trickling``: ``--tricklers`` slow-loris clients (64: every append slot) each send an
  append's headers and then a byte every ``--trickle-every-s`` (2 s: never a stall), and open a
  new connection as soon as the service closes theirs. The normal client appends (retrying a
  ``503`` every 0.1 s, as the SDK backs off) and probes ``/healthz``; per append: the time from
  its first attempt to its success, retries included; per slow connection: what it was
  answered and how long it was held.
- ``flood``: the service under soft and hard open-file limits of ``--flood-nofile`` (1,024),
  ``--flood`` (1,100) connections that open and say nothing: ``/healthz`` latency, what an
  append gets, and how long until appends succeed once the flood goes.

Every scenario runs ``--seconds`` of appends (10 events each). ``--body-timeout`` (the grace of
the minimum body rate; 5 s here, 30 s by default) is short so that a run takes a minute. The service runs from the
checkout the script is in: run a copy of the script in an export of an older commit for a
before/after.
Prints and saves ``benchmarks/results/slow_clients.json`` (``--save-as`` to rename).

Usage: ``python benchmarks/slow_clients.py [--seconds S] [--tricklers N] [--scenarios …]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import percentile, save

from tests.faults._api import Served, create_run, envelope, register, serve, trickle

RUN = "bench"


def _events(first_seq: int, count: int) -> list[dict[str, Any]]:
    """``count`` events of one episode from ``first_seq`` (the first one starts it)."""
    return [
        envelope("e1", seq, type_="episode.started" if seq == 1 else "step.boundary")
        for seq in range(first_seq, first_seq + count)
    ]


@contextlib.asynccontextmanager
async def service(
    workdir: Path, flags: list[str], nofile: int | None = None
) -> AsyncIterator[Served]:
    """A ready ``rolloutlog serve`` (under soft and hard open-file limits of ``nofile``) with the
    benchmark's run and its participant."""
    limits = {resource.RLIMIT_NOFILE: (nofile, nofile)} if nofile is not None else None
    async with serve(workdir, *flags, limits=limits) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            await create_run(client, RUN)
            await register(client, RUN)
        yield served


class Appender:
    """The normal client: appends of 10 events one after another, a ``503`` retried after
    0.1 s; each append's time from first attempt to success."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seq = 1
        self.latencies_ms: list[float] = []
        self.refused = 0
        self.failed = 0
        self.first_success_s: float | None = None

    async def run(self, seconds: float) -> None:
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            while time.monotonic() - started < seconds:
                first = time.monotonic()
                while time.monotonic() - started < seconds:
                    try:
                        reply = await client.post(
                            f"/v1/runs/{RUN}/events", json=_events(self.seq, 10)
                        )
                    except httpx.HTTPError:
                        self.failed += 1
                        await asyncio.sleep(0.1)
                        continue
                    if reply.status_code == 200:
                        self.seq += 10
                        self.latencies_ms.append((time.monotonic() - first) * 1000)
                        if self.first_success_s is None:
                            self.first_success_s = time.monotonic() - started
                        break
                    self.refused += 1
                    await asyncio.sleep(0.1)

    def figures(self) -> dict[str, Any]:
        values = self.latencies_ms
        return {
            "appends": len(values),
            "refusals": self.refused,
            "transport_errors": self.failed,
            "first_success_s": self.first_success_s,
            "latency_ms": {
                "p50": percentile(values, 50),
                "p99": percentile(values, 99),
                "max": max(values, default=float("nan")),
            },
        }


async def probe_healthz(url: str, seconds: float, every_s: float = 0.5) -> dict[str, Any]:
    """``/healthz`` on a fresh connection every ``every_s``: latencies and failures."""
    latencies: list[float] = []
    failures: list[str] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        sent = time.monotonic()
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                reply = await client.get("/healthz")
            if reply.status_code == 200:
                latencies.append((time.monotonic() - sent) * 1000)
            else:
                failures.append(str(reply.status_code))
        except httpx.HTTPError as e:
            failures.append(type(e).__name__)
        await asyncio.sleep(every_s)
    return {
        "probes": len(latencies) + len(failures),
        "failures": len(failures),
        "failure_kinds": sorted(set(failures)),
        "latency_ms": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
    }


async def trickling(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--body-timeout", str(args.body_timeout)]
    async with service(workdir, flags) as served:
        head = (
            f"POST /v1/runs/{RUN}/events HTTP/1.1\r\nHost: 127.0.0.1:{served.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        stop = asyncio.Event()
        replies: list[tuple[bytes, float]] = []
        tasks = [
            asyncio.create_task(trickle(served.port, head, args.trickle_every_s, stop, replies))
            for _ in range(args.tricklers)
        ]
        await asyncio.sleep(1.0)  # the slots are taken
        appender = Appender(served.url)
        health = asyncio.create_task(probe_healthz(served.url, args.seconds))
        await appender.run(args.seconds)
        stop.set()
        await asyncio.gather(*tasks)
        held = [seconds for _, seconds in replies]
        answers: dict[str, int] = {}
        for reply, _ in replies:
            key = reply.split(b"\r\n", 1)[0].decode(errors="replace")
            if b"went to another append" in reply:
                key += " (slot taken by another append)"
            answers[key] = answers.get(key, 0) + 1
        return {
            **appender.figures(),
            "healthz": await health,
            "slow_connections": {
                "answers": answers,
                "held_s": {
                    "p50": percentile(held, 50),
                    "max": max(held, default=float("nan")),
                },
            },
        }


async def quiet(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--body-timeout", str(args.body_timeout)]
    async with service(workdir, flags) as served:
        appender = Appender(served.url)
        health = asyncio.create_task(probe_healthz(served.url, args.seconds))
        await appender.run(args.seconds)
        return {**appender.figures(), "healthz": await health}


def _open_silent(port: int, count: int) -> tuple[list[socket.socket], int]:
    socks, failed = [], 0
    for _ in range(count):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        except OSError:
            failed += 1
    return socks, failed


async def flood(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.flood + 1024), hard))
    flags = ["--header-timeout", "600"]
    try:
        async with service(workdir, flags, nofile=args.flood_nofile) as served:
            url, port, proc = served.url, served.port, served.proc
            opened = time.monotonic()
            socks, failed = await asyncio.to_thread(_open_silent, port, args.flood)
            open_s = time.monotonic() - opened
            descriptors = len(os.listdir(f"/proc/{proc.pid}/fd"))
            health = await probe_healthz(url, min(args.seconds, 10.0), every_s=0.25)
            statuses: dict[str, int] = {}
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                for _ in range(5):
                    try:
                        reply = await client.post(f"/v1/runs/{RUN}/events", json=_events(1, 1))
                        key = str(reply.status_code)
                        if reply.status_code >= 400:
                            key += " " + orjson.loads(reply.content)["error"]["code"]
                    except httpx.HTTPError as e:
                        key = type(e).__name__
                    statuses[key] = statuses.get(key, 0) + 1
            for sock in socks:
                sock.close()
            appender = Appender(url)  # its first success: how long after the flood went
            await appender.run(min(args.seconds, 10.0))
            return {
                "open_files": args.flood_nofile,
                "connections": len(socks),
                "connect_failures": failed,
                "open_s": open_s,
                "service_descriptors_under_flood": descriptors,
                "healthz_under_flood": health,
                "appends_under_flood": statuses,
                "appends_after": appender.figures(),
            }
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "parameters": {
            "seconds": args.seconds,
            "tricklers": args.tricklers,
            "trickle_every_s": args.trickle_every_s,
            "body_timeout_s": args.body_timeout,
            "min_body_rate": "the service's default",
            "flood": args.flood,
            "flood_nofile": args.flood_nofile,
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios.split(","):
            print(f"{name} …", file=sys.stderr)
            workdir = Path(tmp) / name
            workdir.mkdir()
            if name == "quiet":
                results[name] = await quiet(workdir, args)
            elif name == "trickling":
                results[name] = await trickling(workdir, args)
            elif name == "flood":
                results[name] = await flood(workdir, args)
            else:
                raise SystemExit(f"unknown scenario {name!r}")
            print(orjson.dumps(results[name], option=orjson.OPT_INDENT_2).decode())
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tricklers", type=int, default=64)
    parser.add_argument("--trickle-every-s", type=float, default=2.0)
    parser.add_argument("--body-timeout", type=float, default=5.0)
    parser.add_argument("--flood", type=int, default=1100)
    parser.add_argument("--flood-nofile", type=int, default=1024)
    parser.add_argument("--scenarios", default="quiet,trickling,flood")
    parser.add_argument("--save-as", default="slow_clients")
    arguments = parser.parse_args()
    path = save(arguments.save_as, asyncio.run(main(arguments)))
    print(f"saved {path}")
