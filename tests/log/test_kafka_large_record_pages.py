"""Kafka reads of large records ask for small pages (``_kafka_reads._LARGE_RECORDS_PAGE``), so
that a Fetch answer of them stays below the service's mmap threshold; reads of small records
keep the log's page."""

from __future__ import annotations

from typing import Any

import pytest

import rolloutlog.log._kafka_reads as reads
from rolloutlog.log import Record
from rolloutlog.log._kafka_wire import Answer
from tests.log.test_kafka import Opener, open_kafka  # noqa: F401 - the fixture

FETCH_BYTES = 1024 * 1024


@pytest.mark.kafka
async def test_pages_of_large_records_are_small_and_of_small_records_are_the_logs(
    open_kafka: Opener,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_fetch = reads.fetch
    asked: list[int] = []

    async def recording(*args: Any) -> dict[int, Answer]:
        asked.extend(args[4].values())  # the page per partition
        return await real_fetch(*args)

    monkeypatch.setattr(reads, "fetch", recording)
    log = await open_kafka(fetch_bytes=FETCH_BYTES)
    await log.ensure_run("run", 1)
    large = [Record(0, b"k", bytes([65 + i]) * (100 * 1024)) for i in range(24)]
    for start in range(0, len(large), 4):  # batches of 400 KB
        await log.append_records("run", large[start : start + 4])
    small = [Record(0, b"k", b"s%d" % i) for i in range(4000)]
    await log.append_records("run", small)

    got = [item for page in [p async for p in log.read_pages("run", 0, 0, 24)] for item in page]
    assert got == [(i, record.value) for i, record in enumerate(large)]
    # The first answer shows the records are large; every later page is the small one.
    assert asked[0] == FETCH_BYTES
    assert len(asked) > 1 and set(asked[1:]) == {reads._LARGE_RECORDS_PAGE}
    assert reads._LARGE_RECORDS_PAGE < FETCH_BYTES

    asked.clear()
    got = [item for page in [p async for p in log.read_pages("run", 0, 24, 4024)] for item in page]
    assert [value for _, value in got] == [record.value for record in small]
    assert set(asked) == {FETCH_BYTES}
