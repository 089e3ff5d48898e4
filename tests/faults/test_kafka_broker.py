"""Kafka broker faults, caused for real on a private Tansu: every connection reset (through a
proxy), the broker stalled 8 s (SIGSTOP/SIGCONT), and the broker SIGKILLed and restarted EMPTY.

Each asserts the invariant: an append either is acknowledged, and then its record is in the log
at its offset, or is refused with a retriable error (``unavailable``) within the request timeout;
followers fail with retriable errors only (a supervisor restarts them from their offsets); after
the fault, appends succeed again without restarting anything. A broker that lost the run's
records is reported as ``RunLost``, and nothing is acknowledged on top of the lost records.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rolloutlog.errors import BackendUnavailable, RolloutlogError, RunLost, UnknownRun
from rolloutlog.log import Position, Record, open_log, partition_for
from rolloutlog.log.kafka import KafkaLog, from_url
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS
from tests.e2e._harness import Deployment, Service, kafka_log_url
from tests.faults._kafka import FaultyKafka, HttpLoad, faulty_kafka

pytestmark = pytest.mark.kafka

REQUEST_TIMEOUT_MS = 5000
#: An append may take the request timeout, and a retry of its metadata, but never hang.
APPEND_DEADLINE_S = 3 * REQUEST_TIMEOUT_MS / 1000
P = 4


@pytest.fixture
async def kafka() -> AsyncIterator[FaultyKafka]:
    async with faulty_kafka() as broker:
        yield broker


@contextlib.asynccontextmanager
async def kafka_log(broker: FaultyKafka) -> AsyncIterator[KafkaLog]:
    log = from_url(
        f"kafka://{broker.bootstrap}?request_timeout_ms={REQUEST_TIMEOUT_MS}",
        topic_prefix=f"f{uuid.uuid4().hex[:8]}.",
    )
    await log.start()
    try:
        yield log
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30):
                await log.close()


@dataclass
class Workload:
    """Appenders that keep appending, and a supervised ``follow_run`` follower."""

    log: KafkaLog
    run: str
    acked: dict[Position, bytes] = field(default_factory=dict)
    acked_at: list[float] = field(default_factory=list)
    refused: list[RolloutlogError] = field(default_factory=list)
    followed: dict[Position, bytes] = field(default_factory=dict)
    follower_errors: list[RolloutlogError] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def append_one(self, tag: str) -> None:
        records = [
            Record(partition_for(f"{tag}-{i}", P), f"{tag}-{i}".encode(), f"{tag}-{i}".encode())
            for i in range(3)
        ]
        try:
            async with asyncio.timeout(APPEND_DEADLINE_S):
                positions = await self.log.append_records(self.run, records)
        except TimeoutError:
            pytest.fail(f"an append hung past {APPEND_DEADLINE_S} s")
        except BackendUnavailable as e:
            self.refused.append(e)
            await asyncio.sleep(0.05)
            return
        for position, record in zip(positions, records, strict=True):
            self.acked[position] = record.value
        self.acked_at.append(time.monotonic())

    async def appender(self, name: str) -> None:
        count = 0
        while not self.stop.is_set():
            await self.append_one(f"{name}.{count}")
            count += 1

    async def follower(self) -> None:
        """Follows the run; on a retriable error starts again from its offsets, as the
        projector's supervisor does."""
        offsets = [0] * P
        while not self.stop.is_set():
            try:
                async for partition, page in self.log.follow_run(self.run, offsets, poll_s=0.05):
                    for offset, value in page:
                        assert offset == offsets[partition], "pages skip or repeat offsets"
                        self.followed[Position(partition, offset)] = value
                        offsets[partition] = offset + 1
            except RolloutlogError as e:
                assert e.retriable, f"a follower died of a non-retriable error: {e!r}"
                self.follower_errors.append(e)
                await asyncio.sleep(0.2)

    async def run_with(self, fault: Callable[[], Awaitable[float]], after_s: float) -> float:
        """Appenders and the follower during ``fault`` (which returns when the fault ended) and
        ``after_s`` beyond; returns when the fault ended."""
        tasks = [asyncio.create_task(self.appender(f"a{i}")) for i in range(4)]
        follower = asyncio.create_task(self.follower())
        try:
            await asyncio.sleep(0.5)
            ended = await fault()
            await asyncio.sleep(after_s)
        finally:
            self.stop.set()
            await asyncio.gather(*tasks)
            self.stop.clear()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        return ended

    async def assert_acknowledged_are_in_the_log(self) -> None:
        """Every acknowledged record reads back at its offset; the follower saw each of them."""
        for partition in range(P):
            mine = {
                pos.offset: value for pos, value in self.acked.items() if pos.partition == partition
            }
            if not mine:
                continue
            stored = dict(
                [
                    item
                    async for item in self.log.read_records(self.run, partition, 0, max(mine) + 1)
                ]
            )
            for offset, value in mine.items():
                assert stored.get(offset) == value, (
                    f"acknowledged [{partition}]@{offset} not in the log"
                )
        missing = [pos for pos in self.acked if self.followed.get(pos) != self.acked[pos]]
        assert not missing, f"the follower never saw {len(missing)} acknowledged records"

    def caught_up(self) -> bool:
        return all(self.followed.get(pos) == value for pos, value in self.acked.items())

    async def catch_up(self) -> None:
        """Run the follower alone until it has seen every acknowledged record (30 s at most)."""
        follower = asyncio.create_task(self.follower())
        try:
            async with asyncio.timeout(30):
                while not self.caught_up():  # noqa: ASYNC110 - another task's progress
                    await asyncio.sleep(0.1)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower


async def test_every_connection_reset(kafka: FaultyKafka) -> None:
    async with kafka_log(kafka) as log:
        await log.ensure_run("run", P)
        work = Workload(log, "run")

        async def reset() -> float:
            assert kafka.proxy.reset_all() > 0
            return time.monotonic()

        ended = await work.run_with(reset, after_s=3)
        assert any(at > ended + 1 for at in work.acked_at), "appends did not recover"
        await work.catch_up()
        await work.assert_acknowledged_are_in_the_log()


@pytest.mark.slow
async def test_broker_stalled_8s(kafka: FaultyKafka) -> None:
    async with kafka_log(kafka) as log:
        await log.ensure_run("run", P)
        work = Workload(log, "run")

        async def stall() -> float:
            kafka.tansu.stall()
            await asyncio.sleep(8)
            kafka.tansu.resume()
            return time.monotonic()

        ended = await work.run_with(stall, after_s=4)
        assert any(at > ended + 1 for at in work.acked_at), "appends did not recover"
        await work.catch_up()
        await work.assert_acknowledged_are_in_the_log()


@pytest.mark.slow
async def test_broker_killed_and_restarted_empty(kafka: FaultyKafka) -> None:
    async with kafka_log(kafka) as log:
        await log.ensure_run("run", P)
        work = Workload(log, "run")
        for i in range(20):
            await work.append_one(f"before{i}")
        assert len(work.acked) == 60 and not work.refused
        await work.catch_up()
        kafka.restart_empty()
        # The run's records are gone: appends are refused, never acknowledged at offsets that
        # collide with the lost ones (the catalog's checkpoint markers name those).
        lost = [Record(p, b"k", b"after") for p in range(P)]
        await refusal(lambda: log.append_records("run", lost))
        with pytest.raises(RunLost):  # and the next one without waiting for the producer
            async with asyncio.timeout(REQUEST_TIMEOUT_MS / 1000):
                await log.append_records("run", lost)
        ends = [max(pos.offset for pos in work.acked if pos.partition == p) + 1 for p in range(P)]
        await refusal(lambda: anext(log.follow_run("run", ends)))
        await refusal(lambda: anext(log.read_records("run", 0, 0, ends[0])))
        # The log itself recovered: a new run works on the restarted broker.
        await log.ensure_run("next", P)
        assert await log.append_records("next", lost) == [Position(p, 0) for p in range(P)]
        # Another instance (a restarted service) does not recreate the topic.
        async with kafka_log(kafka) as fresh:
            fresh.topic_prefix = log.topic_prefix
            with pytest.raises(UnknownRun):
                await fresh.partitions("run")


class Starved:
    """Starves the broker of CPU for real: SIGSTOP, then SIGCONT for ``on_s`` of every
    ``period_s`` (from a thread: the test's event loop keeps running)."""

    def __init__(self, broker: FaultyKafka, on_s: float = 0.005, period_s: float = 0.010) -> None:
        self.broker = broker
        self.on_s = on_s
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        tansu = self.broker.tansu
        while not self._stop.is_set():
            tansu.stall()
            time.sleep(self.period_s - self.on_s)
            tansu.resume()
            time.sleep(self.on_s)

    def __enter__(self) -> Starved:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
async def test_reads_of_a_long_partition_reach_its_end_on_a_starved_broker(
    kafka: FaultyKafka,
) -> None:
    """12,000 record batches of 4 records in one partition (eight writers appending 4 events at
    a time, as the service's appenders do), then a read and a follow from inside a batch far
    into it while the broker gets half the CPU: both reach the high-water mark, without an
    error, within a bound.

    Tansu bounds a Fetch's work by its ``max_wait``: it lists the partition's batches until the
    wait is over and answers with what it found by then. Listing 12,000 batches takes it more
    than 10 ms at half speed, so a short wait is answered with nothing below the high-water
    mark, every time: the read stalled there until its request timeout, and again after every
    retry."""
    writers = [from_url(f"kafka://{kafka.bootstrap}") for _ in range(8)]
    async with kafka_log(kafka) as log, contextlib.AsyncExitStack() as stack:
        await log.ensure_run("run", 1)
        for writer in writers:
            writer.topic_prefix = log.topic_prefix
            await writer.start()
            stack.push_async_callback(writer.close)

        async def appender(writer: KafkaLog) -> None:
            for i in range(1500):
                batch = [Record(0, b"k", b"%d.%d" % (i, j) + b"." * 100) for j in range(4)]
                await writer.append_records("run", batch)

        await asyncio.gather(*(appender(writer) for writer in writers))
        end = 8 * 1500 * 4
        assert await log.latest_offsets("run") == [end]
        start = end - 4003  # inside a batch: they start at multiples of 4
        with Starved(kafka):
            async with asyncio.timeout(20):
                got = [offset async for offset, _ in log.read_records("run", 0, start, end)]
                assert got == list(range(start, end))
                following = start
                async for _, page in log.follow_run("run", [start]):
                    for offset, _ in page:
                        assert offset == following, "pages skip or repeat offsets"
                        following = offset + 1
                    if following == end:
                        break


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1])
async def test_follows_from_any_offset_reach_the_end_through_resets_and_a_frozen_reader(
    kafka: FaultyKafka, seed: int
) -> None:
    """Four writers append 4-record batches to random partitions all along; four followers
    start at random offsets (mostly inside batches) of every partition; meanwhile every
    connection is reset twice and the reading process is frozen 8.1 s (its event loop blocked,
    as a SIGSTOP does: its requests outlive their timeout). Each follower, restarted from its
    offsets after a retriable error as the projector's supervisor does, delivers every offset
    from its start, once and in order, and reaches the end within 20 s of the last append.
    Seeded: the schedule replays from the seed in the test's id."""
    rng = random.Random(seed)
    print(f"seed {seed}")
    url = f"kafka://{kafka.bootstrap}?request_timeout_ms={REQUEST_TIMEOUT_MS}"
    writers = [from_url(url) for _ in range(4)]
    stop = asyncio.Event()
    async with kafka_log(kafka) as log, contextlib.AsyncExitStack() as stack:
        await log.ensure_run("run", P)
        for writer in writers:
            writer.topic_prefix = log.topic_prefix
            await writer.start()
            stack.push_async_callback(writer.close)

        async def appender(writer: KafkaLog, tag: int) -> None:
            i = 0
            while not stop.is_set():
                partition = rng.randrange(P)
                batch = [Record(partition, b"k", b"%d.%d.%d" % (tag, i, j)) for j in range(4)]
                with contextlib.suppress(BackendUnavailable):  # a reset: the next one goes
                    await writer.append_records("run", batch)
                i += 1

        appenders = [
            asyncio.create_task(appender(writer, tag)) for tag, writer in enumerate(writers)
        ]
        await asyncio.sleep(1.5)
        ends = await log.latest_offsets("run")
        starts = [[rng.randrange(end + 1) for end in ends] for _ in range(4)]
        positions = [list(start) for start in starts]
        restarts = [0] * len(starts)

        async def follower(index: int) -> None:
            offsets = positions[index]
            while True:
                try:
                    async for partition, page in log.follow_run("run", list(offsets)):
                        for offset, _ in page:
                            assert offset == offsets[partition], (
                                f"pages skip or repeat offsets: partition {partition} got "
                                f"{offset} for {offsets[partition]}"
                            )
                            offsets[partition] = offset + 1
                except RolloutlogError as e:
                    assert e.retriable, f"a follower died of a non-retriable error: {e!r}"
                    restarts[index] += 1
                    await asyncio.sleep(0.2)

        followers = [asyncio.create_task(follower(index)) for index in range(len(starts))]
        try:
            for _ in range(2):
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                kafka.proxy.reset_all()
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            time.sleep(8.1)  # noqa: ASYNC251 - the frozen process, on purpose
            await asyncio.sleep(2)
            stop.set()
            await asyncio.gather(*appenders)
            ends = await log.latest_offsets("run")
            deadline = time.monotonic() + 20
            while any(offsets != ends for offsets in positions):
                for task in followers:
                    if task.done():
                        task.result()  # a follower that died: its own error, not a stall
                assert time.monotonic() < deadline, (
                    f"seed {seed}: followers at {positions}, the log ends at {ends} "
                    f"(restarts {restarts})"
                )
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            for task in [*followers, *appenders]:
                task.cancel()
            await asyncio.gather(*followers, *appenders, return_exceptions=True)


async def refusal(operation: Callable[[], Awaitable[object]]) -> RunLost:
    """The ``RunLost`` that ``operation`` ends with, retried after retriable errors for 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            async with asyncio.timeout(APPEND_DEADLINE_S):
                result = await operation()
        except RunLost as e:
            return e
        except BackendUnavailable:
            assert time.monotonic() < deadline, "still unavailable after 30 s"
            await asyncio.sleep(0.2)
            continue
        pytest.fail(f"{result!r} from a broker that lost the run")


# -- through the service ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(
    broker: FaultyKafka, catalog_url: str, workdir: Path
) -> AsyncIterator[tuple[Service, Deployment]]:
    """A real ``rolloutlog serve`` on the faulty broker and a PostgreSQL schema of its own."""
    log_url = f"{kafka_log_url(broker.bootstrap)}&request_timeout_ms=10000"
    deployment = Deployment("kafka", workdir / "data", log_url, catalog_url)
    service = Service(deployment, workdir)
    await service.start()
    try:
        yield service, deployment
    finally:
        service.stop()


async def service_survives(
    broker: FaultyKafka, catalog_url: str, workdir: Path, fault: Callable[[], Awaitable[None]]
) -> None:
    """Appenders over HTTP through ``fault``; then every acknowledged event is in the log and the
    fold, and a checkpoint after the fault commits, with the same service process."""
    async with serving(broker, catalog_url, workdir) as (service, deployment):
        async with AsyncTrainerClient(service.url, token=TOKENS["admin"], timeout_s=60) as trainer:
            await trainer.create_run("run", partitions=P)
            await trainer.take_over("run")
            load = HttpLoad(service.url, "run", trainer, appenders=4)
            await load.checkpoint()
            ended: list[float] = []

            async def timed_fault() -> None:
                await asyncio.sleep(1)
                await fault()
                ended.append(time.monotonic())

            await load.run_for(14, checkpoint_every_s=None, fault=timed_fault)
            assert ended and any(at > ended[0] + 1 for at in load.acked_at), "no recovery"
            assert service.proc is not None and service.proc.poll() is None
            await load.assert_in_the_fold()
            kept_from = await load.kept_from()
        async with open_log(deployment.log_url or "") as log:
            await load.assert_in_the_log(log, kept_from)


@pytest.mark.slow
@pytest.mark.postgres
async def test_service_through_every_connection_reset(
    kafka: FaultyKafka, postgres_schema: str, tmp_path: Path
) -> None:
    async def reset() -> None:
        for _ in range(3):
            assert kafka.proxy.reset_all() > 0
            await asyncio.sleep(1)

    await service_survives(kafka, postgres_schema, tmp_path, reset)


@pytest.mark.slow
@pytest.mark.postgres
async def test_service_through_a_broker_stalled_8s(
    kafka: FaultyKafka, postgres_schema: str, tmp_path: Path
) -> None:
    async def stall() -> None:
        kafka.tansu.stall()
        await asyncio.sleep(8)
        kafka.tansu.resume()

    await service_survives(kafka, postgres_schema, tmp_path, stall)
