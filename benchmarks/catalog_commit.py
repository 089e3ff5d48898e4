"""Benchmark: commit a 16,000-entry manifest and read the latest checkpoint back.

Targets: commit <= 60 ms on SQLite and <= 150 ms on PostgreSQL; reading the latest checkpoint
with its 16,000 entries <= 100 ms on either. Every measured commit runs in steady state: two
committed checkpoints already exist, so retention expires one and deletes its manifest inside
the measured transaction. Prints a table and writes ``benchmarks/results/catalog_commit.json``.

Usage: ``python benchmarks/catalog_commit.py [--runs N] [--entries N] [--postgres URL|none]``
(PostgreSQL defaults to ``ROLLOUTLOG_TEST_POSTGRES_URL`` or the local test server; the benchmark
works in a fresh schema that it drops afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy
from _common import save, summary
from sqlalchemy.engine import make_url

from rolloutlog.catalog import (
    ManifestEntry,
    PartitionOffset,
    RestoreEntry,
    open_catalog,
)

DEFAULT_POSTGRES = os.environ.get(
    "ROLLOUTLOG_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
TARGETS_MS = {
    "sqlite": {"commit": 60.0, "read": 100.0},
    "postgresql": {"commit": 150.0, "read": 100.0},
}
PARTITIONS = 16
STAGES = ("seed", "invoke_agent", "close_agent", "verify", "return")


def manifest(count: int, seed: int) -> list[ManifestEntry]:
    """A realistic manifest: mostly continue, some restart and finished, 0-2 staging keys."""
    rng = random.Random(seed)
    entries = []
    for i in range(count):
        roll = rng.random()
        action = "finished" if roll < 0.10 else "restart" if roll < 0.15 else "continue"
        keys = tuple(f"stage/{seed}/{i:06d}/{k}" for k in range(rng.choice((0, 1, 1, 2))))
        entries.append(
            ManifestEntry(
                episode=f"r{i:06d}",
                attempt=rng.choice((0, 0, 0, 1, 2)),
                action=action,  # type: ignore[arg-type]
                cut_partition=i % PARTITIONS,
                cut_offset=seed * 1_000_000 + i,
                last_stage=rng.choice(STAGES),
                staging_keys=keys,
                size_bytes=rng.randrange(2_000, 200_000),
            )
        )
    return entries


async def measure(url: str, runs: int, count: int) -> dict[str, Any]:
    commit_ms: list[float] = []
    read_ms: list[float] = []
    restore_ms: list[float] = []
    async with open_catalog(url) as catalog:
        await catalog.create_run("bench", partitions=PARTITIONS)
        epoch = await catalog.take_over_controller("bench")
        offsets = [PartitionOffset(p, 50_000 + p, 40_000 + p) for p in range(PARTITIONS)]
        for n in range(runs + 2):
            entries = manifest(count, n)
            checkpoint_id = await catalog.begin_checkpoint("bench", epoch)
            gc.collect()
            started = time.perf_counter()
            await catalog.commit_checkpoint("bench", checkpoint_id, epoch, offsets, entries)
            committed = time.perf_counter()
            latest = await catalog.latest_checkpoint("bench")
            read = await catalog.load_manifest("bench", latest.checkpoint_id)
            done = time.perf_counter()
            assert latest.checkpoint_id == checkpoint_id and len(read) == count
            if n < 2:
                continue  # warm-up: fills retention so that measured commits also expire one
            commit_ms.append((committed - started) * 1000)
            read_ms.append((done - committed) * 1000)
        plan = [
            RestoreEntry(
                entry.episode, 0, 1, "restart" if entry.action == "restart" else "continue"
            )
            for entry in read
            if entry.action != "finished"
        ]
        attempts = await catalog.current_attempts("bench")
        plan = [e._replace(previous_attempt=attempts.get(e.episode, 0)) for e in plan]
        plan = [e._replace(attempt=e.previous_attempt + 1) for e in plan]
        started = time.perf_counter()
        await catalog.commit_restore("bench", epoch, latest.checkpoint_id, plan)
        restore_ms.append((time.perf_counter() - started) * 1000)
    return {
        "commit_ms": summary(commit_ms),
        "read_latest_ms": summary(read_ms),
        "restore_commit_ms": {**summary(restore_ms), "episodes": len(plan)},
        "all_commit_ms": [round(v, 2) for v in commit_ms],
        "all_read_latest_ms": [round(v, 2) for v in read_ms],
    }


def sqlite_floor(runs: int, count: int, directory: Path) -> dict[str, float]:
    """The machine's floor for one row per entry (the layout before packed manifests): the same
    rows into a bare table with plain sqlite3, nothing else. Packed rows commit below it.

    No validation, no encoding, no retention, no other statements: what any per-row SQLite
    catalog would pay on this machine at this moment (the box is shared and often loaded).
    """
    connection = sqlite3.connect(directory / "floor.db", isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute(
        "CREATE TABLE m (run TEXT, checkpoint_id INT, episode TEXT, attempt INT, action TEXT, "
        "cut_partition INT, cut_offset INT, last_stage TEXT, staging_keys TEXT, size_bytes INT, "
        "PRIMARY KEY (run, checkpoint_id, episode)) WITHOUT ROWID"
    )
    timings = []
    try:
        for n in range(runs):
            rows = [
                ("bench", n, e.episode, e.attempt, e.action, e.cut_partition, e.cut_offset,
                 e.last_stage, None, e.size_bytes)
                for e in manifest(count, n)
            ]  # fmt: skip
            started = time.perf_counter()
            connection.execute("BEGIN IMMEDIATE")
            connection.executemany("INSERT INTO m VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
            connection.execute("COMMIT")
            timings.append((time.perf_counter() - started) * 1000)
    finally:
        connection.close()
    return summary(timings)


async def postgres_schema(url: str) -> tuple[str, str, str]:
    """Create a fresh schema; return (catalog URL, admin DSN, schema)."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    base = make_url(url)
    dsn = base.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    catalog_url = base.update_query_dict({"search_path": schema})
    return catalog_url.render_as_string(hide_password=False), dsn, f"{schema}:{version}"


async def drop_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--entries", type=int, default=16_000)
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES, help="URL, or 'none' to skip")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    versions = {"sqlite": sqlite3.sqlite_version, "sqlalchemy": sqlalchemy.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'catalog.db'}"
        results["sqlite"] = await measure(url, args.runs, args.entries)
        results["sqlite"]["floor_bare_insert_ms"] = sqlite_floor(args.runs, args.entries, Path(tmp))
    if args.postgres != "none":
        catalog_url, dsn, tagged = await postgres_schema(args.postgres)
        schema, versions["postgresql"] = tagged.split(":", 1)
        try:
            results["postgresql"] = await measure(catalog_url, args.runs, args.entries)
        finally:
            await drop_schema(dsn, schema)
    load_after = os.getloadavg()
    met = {
        backend: {
            what: results[backend][key]["median"] <= TARGETS_MS[backend][what]
            for what, key in (("commit", "commit_ms"), ("read", "read_latest_ms"))
        }
        for backend in results
    }
    path = save(
        "catalog_commit",
        {
            "entries": args.entries,
            "partitions": PARTITIONS,
            "runs": args.runs,
            "targets_ms": TARGETS_MS,
            "met_by_median": met,
            "versions": versions,
            "load_average": {"before": load_before, "after": load_after},
            "results": results,
        },
    )
    print(
        f"{args.entries} entries, {args.runs} runs, load {load_before[0]:.2f}->{load_after[0]:.2f}"
    )
    for backend, found in results.items():
        for key in ("commit_ms", "read_latest_ms", "restore_commit_ms", "floor_bare_insert_ms"):
            if key not in found:
                continue
            stats = found[key]
            target = TARGETS_MS[backend].get(key.split("_")[0])
            print(
                f"{backend:10s} {key:18s} median {stats['median']:7.1f}  min {stats['min']:7.1f}"
                f"  max {stats['max']:7.1f}" + (f"  target {target:.0f}" if target else "")
            )
    print(f"saved {path}")


if __name__ == "__main__":
    asyncio.run(main())
