"""Append and read-back throughput of the log backends, against their targets.

For each backend: events/s and p50/p99 acknowledgement latency for ~200 B events and MB/s for
350 KB events, appended by concurrent tasks of one process; then read-back throughput (raw records;
"split": records with their metadata decoded, as the projector replays them; fully typed events).
Each figure is the median (with min and max) of ``--runs`` runs. Results are printed and saved to
``benchmarks/results/log_append.json``.

    python benchmarks/log_append.py [--runs 5] [--backends embedded,kafka] [--quick]
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
from collections.abc import Iterator
from typing import Any

from _common import kafka_broker, percentile, save, summary

from rolloutlog.core import partition_for
from rolloutlog.log import Log, Record, encode_record, open_log, record_meta, validate_event

PARTITIONS = 16


def small_event(i: int) -> Any:
    # Encodes to a ~200-byte record.
    return validate_event(
        {
            "type": "step.boundary",
            "episode": f"r{i % 4096}",
            "attempt": 0,
            "step": i % 50,
            "participant": {"id": "env-0", "kind": "environment", "epoch": 1},
            "seq": i,
            "ts": 1764400000.0 + i,
            "data": {"owner": "environment", "stage": "invoke_agent", "next": "close", "state": 1},
        }
    )


def big_event(i: int, blob: str) -> Any:
    return validate_event(
        {
            "type": "session.state",
            "episode": f"r{i}",
            "attempt": 0,
            "participant": {"id": "res-0", "kind": "resources", "epoch": 1},
            "seq": i,
            "ts": 1764400000.0 + i,
            "data": {"session_id": "s1", "state": {"sandbox": blob}},
        }
    )


def to_records(events: list[Any]) -> list[Record]:
    return [
        Record(partition_for(e.episode, PARTITIONS), e.episode.encode(), encode_record(e))
        for e in events
    ]


async def append_run(
    log: Log, run: str, events: list[Any], batch: int, writers: int, encoded: bool
) -> dict[str, float]:
    """Append ``events`` from ``writers`` concurrent tasks in batches; throughput and latency."""
    latencies: list[float] = []
    batches = [events[i : i + batch] for i in range(0, len(events), batch)]
    records = [to_records(b) for b in batches] if encoded else None

    async def writer(w: int) -> None:
        for index in range(w, len(batches), writers):
            started = time.perf_counter()
            if records is not None:
                await log.append_records(run, records[index])
            else:
                await log.append(run, batches[index])
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    elapsed = time.perf_counter() - started
    size = sum(len(encode_record(e)) for e in events[:1000]) / min(len(events), 1000)
    return {
        "events_per_s": len(events) / elapsed,
        "mb_per_s": len(events) * size / elapsed / 1e6,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "record_bytes": size,
    }


async def read_run(log: Log, run: str, mode: str) -> dict[str, float]:
    ends = await log.end_offsets(run)
    count = 0
    size = 0
    started = time.perf_counter()
    for p, end in enumerate(ends):
        if mode == "typed":
            async for _ in log.read(run, p, 0, end):
                count += 1
        else:
            async for page in log.read_pages(run, p, 0, end):
                count += len(page)
                for _, record in page:
                    size += len(record)
                    if mode == "split":
                        record_meta(record)
    elapsed = time.perf_counter() - started
    return {"events_per_s": count / elapsed, "mb_per_s": size / elapsed / 1e6, "events": count}


@contextlib.contextmanager
def backend_url(name: str) -> Iterator[str]:
    if name == "embedded":
        directory = tempfile.mkdtemp(prefix="rolloutlog-bench-")
        try:
            yield f"embedded://{directory}"
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    with kafka_broker() as bootstrap:
        yield f"kafka://{bootstrap}"


async def measure_backend(url: str, runs: int, quick: bool) -> dict[str, Any]:
    small_n = 20_000 if quick else 100_000
    big_n = 60 if quick else 300
    small = [small_event(i) for i in range(small_n)]
    blob = os.urandom(350 * 1024 // 2).hex()
    big = [big_event(i, blob) for i in range(big_n)]
    # The workload is the benchmark's, not the log's: keep the collector from walking it.
    gc.collect()
    gc.freeze()
    cases: dict[str, list[dict[str, float]]] = {}

    def add(name: str, figures: dict[str, float]) -> None:
        cases.setdefault(name, []).append(figures)

    for _ in range(runs):
        async with open_log(url) as log:
            run = f"bench-{uuid.uuid4().hex[:8]}"
            await log.ensure_run(run, PARTITIONS)
            add("append_200B_records", await append_run(log, run, small, 100, 8, True))
            add("append_200B_events", await append_run(log, run, small, 100, 8, False))
            add("append_200B_single_writer", await append_run(log, run, small, 1000, 1, True))
            big_run = f"{run}-big"
            await log.ensure_run(big_run, PARTITIONS)
            add("append_350KB_records", await append_run(log, big_run, big, 4, 8, True))
            add("read_200B_raw", await read_run(log, run, "raw"))
            add("read_200B_split", await read_run(log, run, "split"))
            add("read_200B_typed", await read_run(log, run, "typed"))
            add("read_350KB_raw", await read_run(log, big_run, "raw"))
    gc.unfreeze()
    return {
        name: {key: summary([run[key] for run in values]) for key in values[0]}
        for name, values in cases.items()
    }


TARGETS = {
    "embedded": {
        "append_200B_records.events_per_s": 100_000,
        "append_350KB_records.mb_per_s": 150,
        "read_200B_split.events_per_s": 300_000,
    },
    "kafka": {
        "append_200B_records.events_per_s": 50_000,
        "append_350KB_records.mb_per_s": 150,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="embedded,kafka")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    args = parser.parse_args()
    results: dict[str, Any] = {"runs": args.runs, "quick": args.quick, "backends": {}}
    for name in args.backends.split(","):
        with backend_url(name) as url:
            figures = asyncio.run(measure_backend(url, args.runs, args.quick))
        results["backends"][name] = figures
        print(f"== {name}")
        for case, values in figures.items():
            line = ", ".join(
                f"{key}={value['median']:.1f} [{value['min']:.1f}..{value['max']:.1f}]"
                for key, value in values.items()
                if key in {"events_per_s", "mb_per_s", "p50_ms", "p99_ms"}
            )
            print(f"  {case}: {line}")
        checks = {}
        for key, target in TARGETS.get(name, {}).items():
            case, figure = key.split(".")
            measured = figures[case][figure]["median"]
            checks[key] = {"target": target, "measured": measured, "met": measured >= target}
            print(
                f"  target {key} >= {target}: {measured:.0f} {'met' if measured >= target else 'MISSED'}"
            )
        results["backends"][name]["targets"] = checks
    path = save("log_append" + ("_quick" if args.quick else ""), results)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
