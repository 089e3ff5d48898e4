"""The log contract: every backend must pass every case here (docs/design.md §3)."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from typing import Any

import pytest

from rolloutlog.errors import InvalidEvent, InvalidRequest, PayloadTooLarge, UnknownRun
from rolloutlog.log import (
    CheckpointMarker,
    Event,
    Log,
    Opaque,
    Position,
    Record,
    encode_record,
    partition_for,
    split_record,
)
from tests import factories as f
from tests.contract.conftest import LogFactory

P = 4


async def read_all(log: Log, run: str, partition: int, start: int, end: int) -> list[Any]:
    return [item async for item in log.read(run, partition, start, end)]


async def everything(log: Log, run: str) -> dict[int, list[tuple[int, Event]]]:
    ends = await log.end_offsets(run)
    return {p: await read_all(log, run, p, 0, ends[p]) for p in range(len(ends))}


async def test_ensure_run_creates_and_keeps_partitions(log: Log) -> None:
    assert await log.ensure_run("run-a", P) == P
    assert await log.ensure_run("run-a", P + 3) == P
    assert await log.partitions("run-a") == P


async def test_invalid_run_name_refused(log: Log) -> None:
    with pytest.raises(InvalidRequest):
        await log.ensure_run("bad/name", P)


async def test_unknown_run_raises(log: Log) -> None:
    with pytest.raises(UnknownRun):
        await log.partitions("never-created")
    with pytest.raises(UnknownRun):
        await log.append("never-created", [f.started("r1")])


async def test_append_returns_positions_in_input_order(log: Log) -> None:
    await log.ensure_run("run", P)
    episodes = [f"r{i}" for i in range(20)]
    positions = await log.append("run", [f.started(e) for e in episodes])
    assert len(positions) == len(episodes)
    for episode, position in zip(episodes, positions, strict=True):
        assert isinstance(position, Position)
        assert position.partition == partition_for(episode, P)
    for p, events in (await everything(log, "run")).items():
        got = [event.episode for _, event in events]
        assert got == [e for e in episodes if partition_for(e, P) == p]


async def test_empty_batch_appends_nothing(log: Log) -> None:
    await log.ensure_run("run", P)
    assert await log.append("run", []) == []
    assert await log.end_offsets("run") == [0] * P


async def test_offsets_strictly_increase_per_partition(log: Log) -> None:
    await log.ensure_run("run", P)
    seen: dict[int, list[int]] = defaultdict(list)
    for batch in range(5):
        positions = await log.append("run", [f.started(f"r{batch}-{i}") for i in range(15)])
        for position in positions:
            seen[position.partition].append(position.offset)
    for offsets in seen.values():
        assert offsets == sorted(offsets)
        assert len(set(offsets)) == len(offsets)


async def test_end_offsets_follow_appends(log: Log) -> None:
    await log.ensure_run("run", P)
    positions = await log.append("run", [f.started(f"r{i}") for i in range(30)])
    last: dict[int, int] = {}
    for position in positions:
        last[position.partition] = max(last.get(position.partition, -1), position.offset)
    ends = await log.end_offsets("run")
    for p in range(P):
        assert ends[p] == last.get(p, -1) + 1


async def test_latest_offsets_count_every_record_appended(log: Log) -> None:
    await log.ensure_run("run", P)
    markers = await log.write_markers("run", 1, 1)
    await log.append("run", [f.started(f"r{i}") for i in range(30)])
    ends = await log.end_offsets("run")
    assert all(end > marker for end, marker in zip(ends, markers, strict=True))
    assert await log.latest_offsets("run") == ends


async def test_follow_run_sees_every_partition_from_its_start(log: Log) -> None:
    await log.ensure_run("run", P)
    first = await log.append("run", [f.started(f"r{i}") for i in range(12)])
    starts = [0] * P
    skipped = first[0]  # following from past one record leaves that record out
    starts[skipped.partition] = skipped.offset + 1
    expected = {(pos.partition, pos.offset) for pos in first if pos != skipped}
    seen: set[tuple[int, int]] = set()
    last: dict[int, int] = {}

    pages = log.follow_run("run", starts)

    async def consume() -> None:
        async for partition, page in pages:
            for offset, _ in page:
                assert offset > last.get(partition, -1)  # in order, each once
                last[partition] = offset
                seen.add((partition, offset))
            if expected <= seen:
                return

    await asyncio.wait_for(consume(), timeout=30)
    later = await log.append("run", [f.started(f"s{i}") for i in range(8)])
    expected |= {(pos.partition, pos.offset) for pos in later}
    await asyncio.wait_for(consume(), timeout=30)
    await pages.aclose()
    assert seen == expected


async def test_per_episode_order_under_concurrent_appenders(log: Log) -> None:
    await log.ensure_run("run", P)
    appenders, batches, per_batch = 16, 8, 5

    async def appender(a: int) -> None:
        for b in range(batches):
            events = [
                f.boundary(f"r{a}", stage=f"s{b * per_batch + i}", seq=b * per_batch + i)
                for i in range(per_batch)
            ]
            await log.append("run", events)

    await asyncio.gather(*(appender(a) for a in range(appenders)))
    per_episode: dict[str, list[int]] = defaultdict(list)
    for events in (await everything(log, "run")).values():
        for _, event in events:
            assert event.episode is not None
            per_episode[event.episode].append(event.seq)
    assert len(per_episode) == appenders
    for seqs in per_episode.values():
        assert seqs == list(range(batches * per_batch))


async def test_concurrent_appends_get_distinct_offsets(log: Log) -> None:
    await log.ensure_run("run", P)
    results = await asyncio.gather(
        *(log.append("run", [f.started(f"r{i}-{j}") for j in range(10)]) for i in range(20))
    )
    positions = [position for batch in results for position in batch]
    assert len(set(positions)) == 200
    ends = await log.end_offsets("run")
    assert sum(ends) == 200


async def test_marker_lands_in_every_partition(log: Log) -> None:
    await log.ensure_run("run", P)
    markers = await log.write_markers("run", checkpoint_id=7, controller_epoch=3)
    assert len(markers) == P
    for p, offset in enumerate(markers):
        [(got_offset, event)] = await read_all(log, "run", p, offset, offset + 1)
        assert got_offset == offset
        assert isinstance(event, CheckpointMarker)
        assert event.data.checkpoint_id == 7
        assert event.data.controller_epoch == 3


async def test_marker_splits_the_order_exactly(log: Log) -> None:
    await log.ensure_run("run", P)
    before = await log.append("run", [f.started(f"b{i}") for i in range(40)])
    markers = await log.write_markers("run", 1, 1)
    after = await log.append("run", [f.started(f"a{i}") for i in range(40)])
    for position in before:
        assert position.offset < markers[position.partition]
    for position in after:
        assert position.offset > markers[position.partition]
    for p in range(P):
        events = await read_all(log, "run", p, 0, markers[p])
        assert all(str(event.episode).startswith("b") for _, event in events)


async def test_markers_of_a_later_checkpoint_come_later(log: Log) -> None:
    await log.ensure_run("run", P)
    first = await log.write_markers("run", 1, 1)
    await log.append("run", [f.started(f"r{i}") for i in range(8)])
    second = await log.write_markers("run", 2, 1)
    assert all(b > a for a, b in zip(first, second, strict=True))


async def test_range_read_returns_exactly_the_range(log: Log) -> None:
    await log.ensure_run("run", 1)
    positions = await log.append("run", [f.started(f"r{i}", seq=i) for i in range(50)])
    offsets = [position.offset for position in positions]
    got = await read_all(log, "run", 0, offsets[10], offsets[20])
    assert [offset for offset, _ in got] == offsets[10:20]
    assert [event.seq for _, event in got] == list(range(10, 20))


async def test_empty_and_inverted_ranges_read_nothing(log: Log) -> None:
    await log.ensure_run("run", 1)
    await log.append("run", [f.started(f"r{i}") for i in range(5)])
    assert await read_all(log, "run", 0, 3, 3) == []
    assert await read_all(log, "run", 0, 4, 2) == []


async def test_range_read_stops_at_what_exists(log: Log) -> None:
    await log.ensure_run("run", 1)
    positions = await log.append("run", [f.started(f"r{i}") for i in range(5)])
    got = await read_all(log, "run", 0, positions[0].offset, positions[-1].offset + 1)
    assert len(got) == 5


async def test_read_of_unknown_partition_refused(log: Log) -> None:
    await log.ensure_run("run", P)
    with pytest.raises(InvalidRequest):
        await read_all(log, "run", P, 0, 1)


async def test_every_event_type_round_trips(log: Log) -> None:
    await log.ensure_run("run", 1)
    row = f.ledger_row("r1")
    events = [
        f.started("r1"),
        f.step_started("r1"),
        f.boundary("r1", state={"turns": [1, 2, 3], "text": "é\n\u2028"}),
        row,
        f.chunk("r1"),
        f.session_state("r1", state=[None, True, 1.5]),
        f.finished("r1", result={"answer": 42}),
        f.finished("r1"),
    ]
    positions = await log.append("run", events)
    got = await read_all(log, "run", 0, positions[0].offset, positions[-1].offset + 1)
    assert [event for _, event in got] == events


async def test_records_keep_payloads_apart_from_metadata(log: Log) -> None:
    await log.ensure_run("run", 1)
    event = f.boundary("r1", state={"big": "x" * 1000})
    [position] = await log.append("run", [event])
    [(_, record)] = [
        item async for item in log.read_records("run", 0, position.offset, position.offset + 1)
    ]
    meta, payload = split_record(record)
    assert "state" not in meta["data"]
    assert payload == b'{"big":"' + b"x" * 1000 + b'"}'
    assert record == encode_record(event)


async def test_append_validates_plain_envelopes(log: Log) -> None:
    await log.ensure_run("run", 1)
    envelope = f.envelope("step.started", "r1", {"owner": "environment", "stage": "seed"})
    [position] = await log.append("run", [envelope])
    [(_, event)] = await read_all(log, "run", 0, position.offset, position.offset + 1)
    assert event.type == "step.started"
    assert event.data.mode == "wait"  # the default mode of a step


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda e: e.update(episode="r1-a2"), "episode"),
        (lambda e: e.update(attempt=-1), "attempt"),
        (lambda e: e.update(attempt="1"), "attempt"),
        (lambda e: e.update(type="nope"), "(envelope)"),
        (lambda e: e["data"].pop("stage"), "data.stage"),
        (lambda e: e["participant"].update(kind="robot"), "participant.kind"),
    ],
)
async def test_batch_with_one_invalid_event_appends_nothing(
    log: Log, mutate: Any, field: str
) -> None:
    await log.ensure_run("run", P)
    batch = [
        f.envelope("step.started", f"r{i}", {"owner": "environment", "stage": "seed"})
        for i in range(5)
    ]
    mutate(batch[3])
    with pytest.raises(InvalidEvent) as caught:
        await log.append("run", batch)
    assert caught.value.code == "invalid_event"
    assert caught.value.details["index"] == 3
    assert caught.value.details["field"].startswith(field)
    assert await log.end_offsets("run") == [0] * P


async def test_oversized_event_refused_with_nothing_appended(log_factory: LogFactory) -> None:
    log = await log_factory(max_record_bytes=64 * 1024)
    await log.ensure_run("run", P)
    batch = [f.boundary("r1", state="x" * 1000), f.boundary("r2", state="x" * 70_000)]
    with pytest.raises(PayloadTooLarge) as caught:
        await log.append("run", batch)
    assert caught.value.code == "payload_too_large"
    assert caught.value.details["index"] == 1
    assert await log.end_offsets("run") == [0] * P


async def test_oversized_record_refused_by_append_records(log_factory: LogFactory) -> None:
    """The size limit holds for raw records too (the service's own, the SDK's Kafka path), on
    every backend, before anything is written."""
    log = await log_factory(max_record_bytes=1000)
    await log.ensure_run("run", P)
    batch = [Record(0, b"a", b"x" * 10), Record(1, b"b", b"y" * 1001), Record(2, b"c", b"z")]
    with pytest.raises(PayloadTooLarge) as caught:
        await log.append_records("run", batch)
    assert caught.value.details == {"index": 1, "size": 1001, "max_bytes": 1000}
    assert await log.end_offsets("run") == [0] * P
    [position] = await log.append_records("run", [Record(1, b"b", b"y" * 1000)])
    assert position.offset == 0


async def test_reopen_after_close_keeps_everything(log_factory: LogFactory) -> None:
    log = await log_factory()
    await log.ensure_run("run", P)
    positions = await log.append("run", [f.started(f"r{i}") for i in range(25)])
    markers = await log.write_markers("run", 1, 1)
    before = await everything(log, "run")
    await log.close()
    reopened = await log_factory()
    assert await reopened.partitions("run") == P
    assert await reopened.end_offsets("run") == [m + 1 for m in markers]
    assert await everything(reopened, "run") == before
    more = await reopened.append("run", [f.started("r0")])
    same_partition = [p for p in positions if p.partition == more[0].partition]
    assert more[0].offset == markers[more[0].partition] + 1
    assert all(p.offset < more[0].offset for p in same_partition)


@pytest.mark.parametrize("size", [350 * 1024, 8 * 1024 * 1024])
async def test_large_payloads_round_trip_byte_exact(log: Log, size: int) -> None:
    await log.ensure_run("run", 1)
    blob = os.urandom(size // 2).hex()  # JSON string of `size` characters
    raw = Opaque.of({"blob": blob}).raw
    event = f.session_state("r1", state={"blob": blob})
    [position] = await log.append("run", [event])
    [(_, got)] = await read_all(log, "run", 0, position.offset, position.offset + 1)
    assert got.data.state.raw == raw
    assert got == event


async def test_pages_read_in_place_hold_the_records_pages_hold(log: Log) -> None:
    """``read_pages_in_place`` gives ``read_pages``' records, byte for byte, small and large (a
    backend may give a large one as a read-only view of its storage)."""
    await log.ensure_run("run", 1)
    events = [f.started("r1"), f.session_state("r1", state={"blob": "b" * 400_000})]
    positions = await log.append("run", [*events, f.boundary("r1", "seed", {"n": 1})])
    end = positions[-1].offset + 1
    copied = [item async for page in log.read_pages("run", 0, 0, end) for item in page]
    in_place = [item async for page in log.read_pages_in_place("run", 0, 0, end) for item in page]
    assert len(copied) == 3
    assert [(offset, bytes(record)) for offset, record in in_place] == copied
    assert all(type(record) is bytes or record.readonly for _, record in in_place)


async def test_trim_drops_only_records_below(log: Log) -> None:
    await log.ensure_run("run", 1)
    positions = await log.append("run", [f.started(f"r{i}", seq=i) for i in range(10)])
    offsets = [position.offset for position in positions]
    if not await log.trim("run", 0, offsets[6]):
        pytest.skip("this backend cannot trim (reported False, as the contract allows)")
    got = await read_all(log, "run", 0, 0, offsets[-1] + 1)
    assert [event.seq for _, event in got] == [6, 7, 8, 9]
    [after] = await log.append("run", [f.started("r10")])
    assert after.offset == offsets[-1] + 1
