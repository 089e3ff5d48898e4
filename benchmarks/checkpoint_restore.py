"""Checkpoint and restore latency at the seed's scale, against their targets.

Workloads (deterministic):
- S1: 16,000 live episodes, each ~10 events (start, session, two ledger rows of 512 token ids with
  their session states and boundaries, a step in flight with a generation chunk);
- S2: 1,000 live episodes, each holding a 350 KB session state.

For each backend pair (embedded log + SQLite catalog; Kafka (Tansu) + PostgreSQL), in process:
checkpoint latency (request → committed), restore latency (request → committed plan), the time to
serialize every restored projection (what a bulk fetch sends), and the floor: reading and splitting
the same records with nothing else. Median/min/max of ``--runs`` runs; saved to
``benchmarks/results/checkpoint_restore.json``.

    python benchmarks/checkpoint_restore.py [--runs 5] [--backends embedded,kafka] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import baselines
import orjson
import workloads
from _common import kafka_broker, save, summary

from rolloutlog.api.cli import GC_THRESHOLDS
from rolloutlog.catalog import open_catalog
from rolloutlog.log import Event, Log, Opaque, open_log, validate_event
from rolloutlog.projections import CheckpointResult, Coordinator

PARTITIONS = 16
SEED_FIGURES = {
    "S1": {"checkpoint_s": 1.43 + 2.0, "restore_s": 2.01},
    "S2": {"checkpoint_s": 3.6, "restore_s": 3.4},
}


def s1_episode(index: int) -> list[Event]:
    """The suite's S1 rollout (``workloads.s1_episode``), as validated events."""
    return [validate_event(event) for event in workloads.s1_episode(index)]


def s2_episode(index: int, blob: Opaque) -> list[Event]:
    """The suite's S2 rollout (``workloads.state_episode``) holding ``blob`` (encoded once)."""
    return [validate_event(event) for event in workloads.state_episode(index, blob)]  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def deployment(name: str, kafka: str | None) -> AsyncIterator[tuple[Log, Coordinator, Any]]:
    directory = tempfile.mkdtemp(prefix="rolloutlog-bench-")
    try:
        if name == "embedded":
            log = open_log(f"embedded://{directory}")
            catalog = open_catalog(f"sqlite+aiosqlite:///{directory}/catalog.sqlite3")
        else:
            log = open_log(f"kafka://{kafka}?topic_prefix=b{uuid.uuid4().hex[:8]}.")
            url = os.environ.get(
                "ROLLOUTLOG_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
            )
            catalog = open_catalog(url)
        async with log, catalog:
            coordinator = Coordinator(log, catalog)
            await coordinator.start()
            try:
                yield log, coordinator, catalog
            finally:
                await coordinator.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def floor(log: Log, run: str, ranges: dict[int, tuple[int, int]]) -> float:
    """Reading and splitting the records a restore replays, with nothing else (the suite's
    ``baselines.floor``)."""
    offsets = [{"partition": p, "replay_from": s, "marker": e} for p, (s, e) in ranges.items()]
    return (await baselines.floor(log, run, offsets))[0]


async def measure(
    name: str, kafka: str | None, workload: str, count: int, runs: int
) -> dict[str, Any]:
    blob = Opaque.of({"sandbox": os.urandom(350 * 1024 // 2).hex()}) if workload == "S2" else None
    async with deployment(name, kafka) as (log, coordinator, catalog):
        run = f"{workload.lower()}-{uuid.uuid4().hex[:6]}"
        await coordinator.create_run(run, PARTITIONS)
        epoch = await catalog.take_over_controller(run)
        started = time.perf_counter()
        batch: list[Event] = []
        pending = []
        for index in range(count):
            batch.extend(s1_episode(index) if blob is None else s2_episode(index, blob))
            if len(batch) >= (2000 if blob is None else 16):
                pending.append(asyncio.ensure_future(log.append(run, batch)))
                batch = []
                if len(pending) >= 8:
                    await asyncio.gather(*pending)
                    pending = []
        if batch:
            pending.append(asyncio.ensure_future(log.append(run, batch)))
        await asyncio.gather(*pending)
        load_s = time.perf_counter() - started
        figures: dict[str, list[float]] = {}
        stages: list[dict[str, float]] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            result = await coordinator.checkpoint(run, epoch)
            checkpoint_s = time.perf_counter() - t0
            assert isinstance(result, CheckpointResult)
            assert result.checkpoint.counts["continue"] == count, result.checkpoint.counts
            stages.append(dict(result.timings_ms))
            ranges = {
                o.partition: (o.replay_from or 0, o.marker) for o in result.checkpoint.offsets
            }
            floor_s = await floor(log, run, ranges)
            t0 = time.perf_counter()
            restored = await coordinator.restore(run, epoch, "latest")
            restore_s = time.perf_counter() - t0
            assert restored.restore.counts["continue"] == count, restored.restore.counts
            t0 = time.perf_counter()
            projections = await coordinator.restore_projections(run, restored.restore.restore_id)
            body = b"\n".join(
                orjson.dumps(p.to_json(), default=lambda o: orjson.Fragment(o.raw))
                for p in projections.values()
            )
            fetch_s = time.perf_counter() - t0
            for key, value in {
                "checkpoint_s": checkpoint_s,
                "restore_s": restore_s,
                "restore_and_fetch_s": restore_s + fetch_s,
                "floor_s": floor_s,
                "restore_over_floor": restore_s / floor_s,
                "projections_mb": len(body) / 1e6,
            }.items():
                figures.setdefault(key, []).append(value)
        out: dict[str, Any] = {key: summary(values) for key, values in figures.items()}
        out["load_s"] = load_s
        out["checkpoint_stages_ms"] = {
            key: summary([s[key] for s in stages if key in s]) for key in stages[-1]
        }
        out["live_episodes"] = count
        out["seed"] = SEED_FIGURES[workload]
        return out


TARGETS = {
    ("embedded", "S1", "checkpoint_s"): 0.100,
    ("embedded", "S2", "checkpoint_s"): 0.100,
    ("kafka", "S1", "checkpoint_s"): 0.250,
    ("embedded", "S1", "restore_s"): 1.0,
    ("embedded", "S2", "restore_s"): 1.5,
    ("embedded", "S2", "restore_over_floor"): 1.5,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="embedded,kafka")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    # Measure the service as `rolloutlog serve` runs it: with its collector thresholds.
    gc.set_threshold(*GC_THRESHOLDS)
    backends = args.backends.split(",")
    sizes = {"S1": 2000 if args.quick else 16_000, "S2": 200 if args.quick else 1000}
    results: dict[str, Any] = {"runs": args.runs, "quick": args.quick, "backends": {}}
    with kafka_broker("kafka" in backends) as kafka:
        for name in backends:
            results["backends"][name] = {}
            for workload, count in sizes.items():
                figures = asyncio.run(measure(name, kafka, workload, count, args.runs))
                results["backends"][name][workload] = figures
                print(
                    f"{name} {workload} ({count} episodes): checkpoint "
                    f"{figures['checkpoint_s']['median'] * 1e3:.1f} ms "
                    f"[{figures['checkpoint_s']['min'] * 1e3:.1f}..{figures['checkpoint_s']['max'] * 1e3:.1f}], "
                    f"restore {figures['restore_s']['median'] * 1e3:.0f} ms, "
                    f"+fetch {figures['restore_and_fetch_s']['median'] * 1e3:.0f} ms, "
                    f"floor {figures['floor_s']['median'] * 1e3:.0f} ms "
                    f"(restore/floor {figures['restore_over_floor']['median']:.2f})"
                )
                print(
                    f"   checkpoint stages (ms): { {k: round(v['median'], 1) for k, v in figures['checkpoint_stages_ms'].items()} }"
                )
    checks = {}
    for (name, workload, key), target in TARGETS.items():
        if name in results["backends"] and not args.quick:
            measured = results["backends"][name][workload][key]["median"]
            checks[f"{name}.{workload}.{key}"] = {
                "target": target,
                "measured": measured,
                "met": measured <= target,
            }
            print(
                f"target {name} {workload} {key} <= {target}: {measured:.3f} {'met' if measured <= target else 'MISSED'}"
            )
    results["targets"] = checks
    print(f"saved {save('checkpoint_restore' + ('_quick' if args.quick else ''), results)}")


if __name__ == "__main__":
    main()
