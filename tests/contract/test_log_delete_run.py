"""``Log.delete_run`` on every backend (runs can be deleted; a fresh run reuses the name)."""

from __future__ import annotations

import asyncio

import pytest

from rolloutlog.errors import InvalidRequest, RunLost, UnknownRun
from rolloutlog.log import Log
from rolloutlog.log._interface import MAX_PARTITIONS
from tests import factories as f

P = 4


async def test_deleted_run_is_gone_and_its_name_starts_afresh(log: Log) -> None:
    await log.ensure_run("doomed", P)
    await log.append("doomed", [f.started(f"r{i}") for i in range(10)])
    assert await log.delete_run("doomed") is True
    with pytest.raises(UnknownRun):
        await log.partitions("doomed")
    assert await log.delete_run("doomed") is False
    assert await log.ensure_run("doomed", 2) == 2
    assert await log.end_offsets("doomed") == [0, 0]
    [position] = await log.append("doomed", [f.started("r1")])
    assert position.offset == 0


async def test_delete_run_ends_its_follower(log: Log) -> None:
    await log.ensure_run("followed", P)
    await log.append("followed", [f.started("r1")])
    seen = asyncio.Event()

    async def follow() -> None:
        async for _ in log.follow_run("followed", [0] * P):
            seen.set()

    follower = asyncio.create_task(follow())
    async with asyncio.timeout(20):
        await seen.wait()
    await log.delete_run("followed")
    try:
        async with asyncio.timeout(20):
            # Embedded: the run's file is gone (UnknownRun); Kafka: the broker reports the topic
            # gone or empty below what was read (RunLost). Either way the follower ends.
            with pytest.raises((UnknownRun, RunLost)):
                await follower
    finally:
        follower.cancel()


async def test_partitions_above_the_limit_are_refused(log: Log) -> None:
    with pytest.raises(InvalidRequest):
        await log.ensure_run("wide", MAX_PARTITIONS + 1)
    assert await log.ensure_run("widest", MAX_PARTITIONS) == MAX_PARTITIONS
