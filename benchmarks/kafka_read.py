"""Reading a partition back on Kafka: the log's raw Fetch reads against aiokafka's consumer.

One run of ``--partitions`` partitions is filled as the service's appenders fill it: eight
writers (a ``KafkaLog`` each) appending 4-record batches of ~300-byte records. Then each
partition is read from offset 0 to its end, and again from inside a batch ``--tail`` records
before its end (where a projector resumes), by:

- ``raw``: ``KafkaLog.read_pages`` (raw Fetch requests, ``_kafka_wire.parse_records``);
- ``consumer``: ``AIOKafkaConsumer`` with manual ``assign()``/``seek()`` and no group
  (``getmany`` until the position reaches the end), the library's way to do the same.

Figures: records per second of wall time and µs of this process's CPU per record for the whole
partitions, and the wall time of the tail read; each the median of ``--runs`` runs.

Then the projector's fold rate through each: ``--episodes`` S1 rollouts (``workloads``) appended
into a 16-partition run, and fresh projectors catching up from offset 0 (``Projector`` reads a
catch-up through ``read_pages``; for ``consumer``, a ``KafkaLog`` whose ``read_pages`` is the
consumer's): CPU µs per record and records per second of wall time, as
``projector_fold.py --backends kafka`` measures them.

Kafka is Tansu started as the tests start it, or ``ROLLOUTLOG_BENCH_KAFKA``. Saved to
``benchmarks/results/kafka_read.json``.

    python benchmarks/kafka_read.py [--writers 8] [--appends 2500] [--partitions 2] [--runs 5]
        [--episodes 4000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import workloads
from _common import kafka_broker, save, summary, time_catch_up
from aiokafka import AIOKafkaConsumer, TopicPartition

from rolloutlog.log import Record
from rolloutlog.log.kafka import KafkaLog, from_url

RUN = "bench"
PAGE_BYTES = 4 * 1024 * 1024


async def fill(url: str, writers: int, appends: int, partitions: int) -> list[int]:
    logs = [from_url(url) for _ in range(writers)]
    for log in logs:
        await log.start()
    try:
        await logs[0].ensure_run(RUN, partitions)

        async def writer(index: int, log: KafkaLog) -> None:
            for i in range(appends):
                partition = (index + i) % partitions
                value = b"%d.%d." % (index, i) + b"x" * 300
                await log.append_records(RUN, [Record(partition, b"k", value)] * 4)

        await asyncio.gather(*(writer(index, log) for index, log in enumerate(logs)))
        return await logs[0].latest_offsets(RUN)
    finally:
        for log in logs:
            await log.close()


async def read_raw(log: KafkaLog, partition: int, start: int, end: int) -> int:
    count = 0
    async for page in log.read_pages(RUN, partition, start, end):
        count += len(page)
    return count


async def read_consumer(consumer: Any, topic: str, partition: int, start: int, end: int) -> int:
    target = TopicPartition(topic, partition)
    consumer.assign([target])
    consumer.seek(target, start)
    count = 0
    while await consumer.position(target) < end:
        batches = await consumer.getmany(target, timeout_ms=1000)
        for record in batches.get(target, []):
            if start <= record.offset < end:
                count += 1
    return count


def new_consumer(bootstrap_servers: str) -> Any:
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="none",
        max_partition_fetch_bytes=PAGE_BYTES,
        fetch_max_bytes=PAGE_BYTES * 4,
    )


class ConsumerReadLog(KafkaLog):
    """A ``KafkaLog`` whose bounded reads (a projector's catch-up) go through the consumer."""

    consumer: Any = None

    async def read_pages(  # type: ignore[override]
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        target = TopicPartition(self.topic_name(run), partition)
        consumer = self.consumer
        consumer.assign([target])
        consumer.seek(target, start)
        while await consumer.position(target) < end:
            batches = await consumer.getmany(target, timeout_ms=1000)
            page = [
                (record.offset, record.value)
                for record in batches.get(target, [])
                if start <= record.offset < end
            ]
            if page:
                yield page


async def fold(url: str, episodes: int, runs: int) -> dict[str, Any]:
    """S1's rollouts in a 16-partition run; fresh projectors catch up through each reader."""
    run = f"fold-{uuid.uuid4().hex[:6]}"
    partitions = 16
    raw, library = from_url(url), ConsumerReadLog(url.split("://", 1)[1].split("?")[0])
    library.topic_prefix = raw.topic_prefix
    await raw.start()
    await library.start()
    library.consumer = new_consumer(library.bootstrap_servers)
    await library.consumer.start()
    figures: dict[str, Any] = {}
    try:
        await raw.ensure_run(run, partitions)
        chunk: list[dict[str, Any]] = []
        for index in range(episodes):
            chunk.extend(workloads.s1_episode(index))
            if len(chunk) >= 2000 or index == episodes - 1:
                await raw.append(run, chunk)
                chunk = []
        records = sum(await raw.latest_offsets(run))
        samples: dict[str, dict[str, list[float]]] = {
            name: {"cpu_us": [], "rate": []} for name in ("raw", "consumer")
        }
        for _ in range(runs):
            for name, log in (("raw", raw), ("consumer", library)):
                cpu_us, rate = await time_catch_up(log, run, partitions, records)
                samples[name]["cpu_us"].append(cpu_us)
                samples[name]["rate"].append(rate)
        figures["records"] = records
        for name, values in samples.items():
            figures[name] = {
                "cpu_us_per_record": summary(values["cpu_us"]),
                "events_per_s_wall": summary(values["rate"]),
            }
        await raw.delete_run(run)
    finally:
        await library.consumer.stop()
        await library.close()
        await raw.close()
    return figures


async def measure(url: str, ends: list[int], tail: int, runs: int) -> dict[str, Any]:
    log = from_url(url)
    await log.start()
    topic = log.topic_name(RUN)
    consumer = new_consumer(log.bootstrap_servers)
    await consumer.start()
    total = sum(ends)
    figures: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "cpu_us": [], "tail_ms": []} for name in ("raw", "consumer")
    }
    try:
        for _ in range(runs):
            for name in ("raw", "consumer"):

                async def read(partition: int, start: int, name: str = name) -> int:
                    end = ends[partition]
                    if name == "raw":
                        return await read_raw(log, partition, start, end)
                    return await read_consumer(consumer, topic, partition, start, end)

                cpu, wall = time.process_time(), time.perf_counter()
                count = sum([await read(partition, 0) for partition in range(len(ends))])
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                assert count == total, (name, count, total)
                figures[name]["rate"].append(total / wall)
                figures[name]["cpu_us"].append(cpu / total * 1e6)
                # From inside a batch (they hold 4 records), far into the partition.
                start = ends[0] - tail - 3
                wall = time.perf_counter()
                assert await read(0, start) == ends[0] - start
                figures[name]["tail_ms"].append((time.perf_counter() - wall) * 1000)
    finally:
        await consumer.stop()
        await log.close()
    return {
        name: {
            "records_per_s_wall": summary(values["rate"]),
            "cpu_us_per_record": summary(values["cpu_us"]),
            "tail_read_ms": summary(values["tail_ms"]),
        }
        for name, values in figures.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--appends", type=int, default=2500)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--tail", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=4000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.appends, args.runs, args.tail, args.episodes = 200, 2, 400, 500
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    logging.getLogger("rolloutlog").setLevel(logging.ERROR)
    with kafka_broker() as bootstrap:
        url = f"kafka://{bootstrap}?topic_prefix=b{uuid.uuid4().hex[:8]}."
        ends = asyncio.run(fill(url, args.writers, args.appends, args.partitions))
        figures = asyncio.run(measure(url, ends, args.tail, args.runs))
        folds = asyncio.run(fold(url, args.episodes, args.runs))
    for name, values in figures.items():
        print(
            f"{name}: {values['records_per_s_wall']['median']:,.0f} records/s wall, "
            f"{values['cpu_us_per_record']['median']:.2f} CPU µs/record, "
            f"tail of {args.tail} records in {values['tail_read_ms']['median']:.1f} ms"
        )
    raw, library = figures["raw"], figures["consumer"]
    ratio = raw["records_per_s_wall"]["median"] / library["records_per_s_wall"]["median"]
    cpu_ratio = library["cpu_us_per_record"]["median"] / raw["cpu_us_per_record"]["median"]
    print(f"raw / consumer: {ratio:.2f}x records/s, {cpu_ratio:.2f}x less CPU per record")
    for name in ("raw", "consumer"):
        values = folds[name]
        print(
            f"fold through {name}: {values['cpu_us_per_record']['median']:.2f} CPU µs/record, "
            f"{values['events_per_s_wall']['median']:,.0f} records/s wall "
            f"({folds['records']} records)"
        )
    results = {
        "writers": args.writers,
        "appends_per_writer": args.appends,
        "records_per_append": 4,
        "partitions": args.partitions,
        "records": sum(ends),
        "tail": args.tail,
        "runs": args.runs,
        "quick": args.quick,
        "page_bytes": PAGE_BYTES,
        "raw_over_consumer_records_per_s": ratio,
        "consumer_over_raw_cpu_per_record": cpu_ratio,
        **figures,
        "fold": {"episodes": args.episodes, **folds},
    }
    name = "kafka_read" + ("_quick" if args.quick else "")
    print(f"saved {save(name, results)}")


if __name__ == "__main__":
    main()
