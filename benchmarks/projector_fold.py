"""The projector's per-record cost: applying S1 records to its trackers (the fold's metadata mode),
in process and through each log backend.

In process, no log: S1's rollouts (``workloads.s1_episode``: 10 records each) are encoded as the
log keeps them and fed in partition order to ``Projector._take``, which is what the projector's
follower does with each record it reads: peek the envelope, check it (``metadata_problem``, the
home partition), and apply it to the episode's tracker. Figures: µs per record for the whole
``_take``, for the decoding alone (``peek_record``), for the check alone (``metadata_problem``)
and for the tracker's share (``EpisodeTracker.observe`` on the same records); and the bytes a
projector holds per live episode once it took them (tracemalloc: its trackers and maps).

Through a log (``--backends embedded,kafka``; Kafka is Tansu started as the tests start it, or
``ROLLOUTLOG_BENCH_KAFKA``): the same records appended straight into a run (no service), then
fresh projectors catch up from offset 0 as the suite's ``fold_rate`` does (read + fold, one
process): µs of this process's CPU per record, and records per second of wall time (which on a
shared machine includes the broker's and the neighbours' time).

Each figure is the median of ``--runs`` runs (each on fresh trackers), timed in CPU seconds of
this process (``time.process_time``): on a shared machine, wall time mostly measures the
neighbours. Saved to ``benchmarks/results/projector_fold.json`` (or ``--save-as NAME``).

    python benchmarks/projector_fold.py [--episodes 4000] [--runs 7] [--backends embedded,kafka]
        [--quick] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import statistics
import tempfile
import time
import tracemalloc
import uuid
from typing import Any

import workloads
from _common import kafka_broker, save, summary, time_catch_up

from rolloutlog.api.cli import GC_THRESHOLDS
from rolloutlog.log import encode_record, open_log, partition_for, peek_record, validate_event
from rolloutlog.projections._projector import Projector
from rolloutlog.projections._quarantine import metadata_problem
from rolloutlog.projections._tracker import EpisodeTracker

PARTITIONS = 16


def records(episodes: int) -> list[list[bytes]]:
    """Per partition, the S1 records in the order a producer appends them (episode by episode)."""
    out: list[list[bytes]] = [[] for _ in range(PARTITIONS)]
    for index in range(episodes):
        for event in workloads.s1_episode(index):
            typed = validate_event(event)
            out[partition_for(typed.episode, PARTITIONS)].append(encode_record(typed))
    return out


def time_take(partitions: list[list[bytes]]) -> float:
    """Seconds for one projector to take every record (fresh trackers)."""
    projector = Projector(None, "bench", PARTITIONS)  # type: ignore[arg-type]
    projector.caught_up = True
    take = projector._take
    started = time.process_time()
    for partition, page in enumerate(partitions):
        for offset, record in enumerate(page):
            take(partition, offset, record)
    elapsed = time.process_time() - started
    assert not projector.quarantined_count, projector.new_quarantined[:1]
    return elapsed


def bytes_per_episode(partitions: list[list[bytes]], episodes: int) -> float:
    """Bytes a fresh projector holds per episode once it took every record (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        projector = Projector(None, "bench", PARTITIONS)  # type: ignore[arg-type]
        projector.caught_up = True
        for partition, page in enumerate(partitions):
            for offset, record in enumerate(page):
                projector._take(partition, offset, record)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del projector
    return held / episodes


def time_observe(partitions: list[list[bytes]], peeked: list[list[Any]]) -> float:
    """Seconds for the trackers alone to observe every record (metadata decoded beforehand)."""
    trackers: dict[str, EpisodeTracker] = {}
    whole = "start" in inspect.signature(EpisodeTracker.observe).parameters
    started = time.process_time()
    for partition, page in enumerate(partitions):
        for offset, (record, (meta, start)) in enumerate(zip(page, peeked[partition], strict=True)):
            episode = meta["episode"]
            tracker = trackers.get(episode)
            if tracker is None:
                tracker = trackers[episode] = EpisodeTracker(episode, partition)
            if whole:
                tracker.observe(offset, meta, record, start)
            else:  # before the payload's start was passed in
                tracker.observe(offset, meta, record)  # type: ignore[call-arg]
    return time.process_time() - started


def time_each(function: Any, items: list[Any]) -> float:
    """Seconds for ``function`` over every item (results dropped as they come)."""
    started = time.process_time()
    for item in items:
        function(item)
    return time.process_time() - started


async def catch_up(url: str, episodes: int, runs: int) -> dict[str, Any]:
    """S1's records appended into a fresh run of the log at ``url``, then ``runs`` projectors
    each catching up from offset 0: CPU µs per record and records per second of wall time."""
    run = f"fold-{uuid.uuid4().hex[:6]}"
    async with open_log(url) as log:
        await log.ensure_run(run, PARTITIONS)
        chunk: list[dict[str, Any]] = []
        for index in range(episodes):
            chunk.extend(workloads.s1_episode(index))
            if len(chunk) >= 2000 or index == episodes - 1:
                await log.append(run, chunk)
                chunk = []
        records = sum(await log.end_offsets(run))
        cpu_us: list[float] = []
        rates: list[float] = []
        for _ in range(runs):
            cpu_per_record, rate = await time_catch_up(log, run, PARTITIONS, records)
            cpu_us.append(cpu_per_record)
            rates.append(rate)
        await log.delete_run(run)
    return {
        "records": records,
        "cpu_us_per_record": summary(cpu_us),
        "events_per_s_wall": summary(rates),
    }


def backends_figures(names: list[str], episodes: int, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with kafka_broker("kafka" in names) as kafka, tempfile.TemporaryDirectory() as directory:
        for name in names:
            if name == "kafka":
                url = f"kafka://{kafka}?topic_prefix=f{uuid.uuid4().hex[:8]}."
            else:
                url = f"embedded://{directory}"
            out[name] = asyncio.run(catch_up(url, episodes, runs))
            figures = out[name]
            print(
                f"{name}: catch-up {figures['cpu_us_per_record']['median']:.2f} CPU µs/record, "
                f"{figures['events_per_s_wall']['median']:.0f} records/s wall"
            )
    return out


def peek_all(partitions: list[list[bytes]]) -> list[list[Any]]:
    return [[peek_record(record) for record in page] for page in partitions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--backends", default="", help="also catch up through these logs: embedded,kafka"
    )
    parser.add_argument("--save-as", default="", help="result file name (default: projector_fold)")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.runs = 500, 3
    gc.set_threshold(*GC_THRESHOLDS)
    partitions = records(args.episodes)
    peeked = peek_all(partitions)
    flat = [record for page in partitions for record in page]
    metas = [meta for page in peeked for meta, _ in page]
    count = len(flat)
    take_us: list[float] = []
    peek_us: list[float] = []
    check_us: list[float] = []
    observe_us: list[float] = []
    for _ in range(args.runs):
        gc.collect()
        take_us.append(time_take(partitions) / count * 1e6)
        gc.collect()
        peek_us.append(time_each(peek_record, flat) / count * 1e6)
        check_us.append(time_each(metadata_problem, metas) / count * 1e6)
        gc.collect()
        observe_us.append(time_observe(partitions, peeked) / count * 1e6)
    results: dict[str, Any] = {
        "episodes": args.episodes,
        "records": count,
        "runs": args.runs,
        "quick": args.quick,
        "take_us_per_record": summary(take_us),
        "peek_us_per_record": summary(peek_us),
        "check_us_per_record": summary(check_us),
        "observe_us_per_record": summary(observe_us),
        "bytes_per_live_episode": round(bytes_per_episode(partitions, args.episodes)),
    }
    print(
        f"{count} records: Projector._take {statistics.median(take_us):.2f} µs/record "
        f"[{min(take_us):.2f}..{max(take_us):.2f}]; of which peek_record "
        f"{statistics.median(peek_us):.2f}, metadata_problem {statistics.median(check_us):.2f}, "
        f"tracker.observe {statistics.median(observe_us):.2f}; "
        f"{results['bytes_per_live_episode']} bytes per live episode"
    )
    names = [name for name in args.backends.split(",") if name]
    if names:
        results["catch_up"] = backends_figures(names, args.episodes, args.runs)
    name = args.save_as or "projector_fold" + ("_quick" if args.quick else "")
    print(f"saved {save(name, results)}")


if __name__ == "__main__":
    main()
