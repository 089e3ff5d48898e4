"""The suite's append figures: S4's checkpoints while a separate process (the suite again, with
``--saturate``: ``saturate``) appends through the SDK as fast as the service acknowledges, and
the HTTP append figures of ``api_append.py`` (``http_appends``).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from _common import ROOT, percentile, summary
from suite_service import Service
from workloads import churn_batch

from rolloutlog.participants import HttpTransport, KafkaTransport, Transport
from rolloutlog.trainer import AsyncTrainerClient

#: The suite's entry point: ``suite.py --saturate`` runs ``saturate`` in a process of its own.
SUITE = Path(__file__).with_name("suite.py")


def start_loader(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)


async def saturated_checkpoints(
    svc: Service, trainer: AsyncTrainerClient, run: str, live: int, runs: int, writers: int
) -> dict[str, Any]:
    """S4: checkpoints while a separate process appends through the SDK as fast as the service
    acknowledges (closed loop, ``writers`` transports). A checkpoint before the load starts
    (untimed) is the previous one of the first measured, as in a live run (the restores before
    gave every episode a new attempt)."""
    await trainer.checkpoint(run)
    seconds = 2.5 + runs * 1.5
    cmd = [sys.executable, str(SUITE), "--saturate", svc.url, run, str(seconds), str(writers)]
    if svc.deployment.log_url:
        cmd += ["--saturate-log", svc.deployment.log_url]
    loader = start_loader(cmd)
    try:
        await asyncio.sleep(1.5)  # registered and appending at full rate
        times = []
        stages: dict[str, list[float]] = {}
        before = svc.cpu_s()
        for _ in range(runs):
            t0 = time.perf_counter()
            info = await trainer.checkpoint(run)
            times.append(time.perf_counter() - t0)
            assert info.status == "committed", info
            assert info.counts["continue"] >= live, info.counts
            for stage, value in info.timings_ms.items():
                stages.setdefault(stage, []).append(float(value))
            await asyncio.sleep(0.3)
        cpu = svc.cpu_s() - before
        out_bytes, _ = await asyncio.to_thread(loader.communicate, timeout=seconds + 120)
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait()
    appends = orjson.loads(out_bytes.strip().splitlines()[-1])
    return {
        "checkpoint_s": summary(times),
        # The service's own stage timings, as S1's: queueing on the event loop behind the
        # appends is what the request's time has beyond their ``total``.
        "stages_ms": {
            "checkpoint": {stage: statistics.median(values) for stage, values in stages.items()}
        },
        "appends": appends,
        "service_cpu_s_during": cpu,
    }


async def saturate(url: str, run: str, seconds: float, writers: int, log_url: str | None) -> None:
    latencies: list[float] = []
    done = 0

    async def writer(index: int) -> None:
        nonlocal done
        options: dict[str, Any] = {"max_batch": 100}
        t: Transport = (
            KafkaTransport(log_url, url=url, **options)
            if log_url
            else HttpTransport(url, **options)
        )
        async with t:
            epoch = await t.register(run, f"churn-{index}", "environment")
            seq = 1
            stop_at = started + seconds
            while time.perf_counter() < stop_at:
                batch = churn_batch(index, epoch, seq, 100)
                seq += 100
                t0 = time.perf_counter()
                await t.append(run, batch)
                latencies.append(time.perf_counter() - t0)
                done += len(batch)

    started = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    elapsed = time.perf_counter() - started
    result = {
        "writers": writers,
        "batch": 100,
        "events_per_s": done / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "requests": len(latencies),
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


#: Runs and seconds per phase of the HTTP append part (``api_append.measure``).
APPEND_RUNS = {"full": (3, 4.0), "quick": (1, 2.0)}


def http_appends(runs_and_seconds: tuple[int, float]) -> dict[str, Any]:
    """The HTTP append figures, measured by ``benchmarks/api_append.py`` (its ``measure``:
    a fresh ``rolloutlog serve`` on the embedded log per run, with the service's default options;
    8 clients, batches of 100, closed loop → events/s; then paced at half that → p50/p99)."""
    import api_append

    runs, seconds = runs_and_seconds
    figures = api_append.measure(runs, seconds, [], {"this tree": ROOT})["this tree"]
    return {
        **figures,
        "runs": runs,
        "seconds_per_phase": seconds,
        "batch": api_append.BATCH,
        "clients": api_append.CLIENTS,
    }
