"""Shared helpers of the benchmark scripts: timing statistics, machine facts, result files."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
#: The deployments the suite measures, as the results name them.
DEPLOYMENTS = {"embedded": "embedded", "kafka": "Kafka (Tansu) + PostgreSQL"}
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": len(values),
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        ).stdout.strip()
        # Measured code that differs from the commit (the service runs from this tree) says so.
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "rolloutlog"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        ).stdout.strip()
        if commit and changed:
            commit += "-dirty"
    except OSError:
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "commit": commit,
    }


def save(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    document = {"benchmark": name, "machine": machine(), **results}
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    return path


@contextlib.contextmanager
def kafka_broker(needed: bool = True) -> Iterator[str | None]:
    """A Kafka bootstrap address: ``ROLLOUTLOG_BENCH_KAFKA`` when set, else a Tansu broker started
    for the benchmark (as the tests start it); None when not ``needed``."""
    if not needed:
        yield None
        return
    explicit = os.environ.get("ROLLOUTLOG_BENCH_KAFKA")
    if explicit:
        yield explicit
        return
    from tests._services import tansu_broker

    with tansu_broker() as bootstrap:
        yield bootstrap


def serve_command(data_dir: str | Path, port: int, *extra: str) -> list[str]:
    """``rolloutlog serve`` over ``data_dir`` on ``port`` (warnings only), for a subprocess."""
    return [
        sys.executable,
        "-m",
        "rolloutlog.api.cli",
        "serve",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]


async def time_catch_up(log: Any, run: str, partitions: int, records: int) -> tuple[float, float]:
    """One projector folding ``run`` from offset 0 to the end: (CPU µs per record, records/s)."""
    import gc
    import time

    from rolloutlog.projections._projector import Projector, StartPlan

    projector = Projector(log, run, partitions)

    async def plan() -> StartPlan:
        return StartPlan([0] * partitions)

    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    projector.launch(plan)
    await projector.settled.wait()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert projector.health.status == "ok", projector.health
    assert projector.events_applied == records, (projector.events_applied, records)
    await projector.stop()
    return cpu / records * 1e6, records / wall


def log(message: str) -> None:
    """A line of a script's progress, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until ``url``'s ``/readyz`` answers 200; ``RuntimeError`` if ``proc`` exits first or
    ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the service at {url} did not become ready")
        time.sleep(0.1)


async def append_in_chunks(
    append: Callable[[str, list[Any]], Awaitable[Any]],
    run: str,
    episodes: Iterable[Sequence[Any]],
    chunk_size: int,
    window: int,
) -> None:
    """Append the episodes' events to ``run`` in chunks of about ``chunk_size`` events, with at
    most ``window`` appends in flight."""
    pending: list[asyncio.Future[Any]] = []
    chunk: list[Any] = []
    for events in episodes:
        chunk.extend(events)
        if len(chunk) >= chunk_size:
            pending.append(asyncio.ensure_future(append(run, chunk)))
            chunk = []
        if len(pending) >= window:
            await pending.pop(0)
    if chunk:
        pending.append(asyncio.ensure_future(append(run, chunk)))
    await asyncio.gather(*pending)
