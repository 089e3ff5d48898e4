"""An embedded catalog's writers take turns (``rolloutlog.catalog._turns``): one at a time, a
checkpoint's before the others waiting, and a writer cancelled while waiting, or just as its
turn came, never stalls the ones after it."""

from __future__ import annotations

import asyncio

from rolloutlog.catalog._turns import WriteTurns


async def test_one_writer_at_a_time_urgent_ones_first() -> None:
    turns = WriteTurns()
    order: list[str] = []
    release = asyncio.Event()

    async def write(name: str, urgent: bool = False, hold: asyncio.Event | None = None) -> None:
        async with turns.turn(urgent=urgent):
            order.append(f"{name}+")
            if hold is not None:
                await hold.wait()
            await asyncio.sleep(0)
            order.append(f"{name}-")

    first = asyncio.create_task(write("feeder1", hold=release))
    await asyncio.sleep(0)
    rest = [
        asyncio.create_task(write("feeder2")),
        asyncio.create_task(write("feeder3")),
        asyncio.create_task(write("checkpoint", urgent=True)),
    ]
    await asyncio.sleep(0.01)
    assert order == ["feeder1+"]
    release.set()
    await asyncio.gather(first, *rest)
    assert order == [
        *("feeder1+", "feeder1-"),
        *("checkpoint+", "checkpoint-"),
        *("feeder2+", "feeder2-"),
        *("feeder3+", "feeder3-"),
    ]


async def test_a_cancelled_writer_passes_its_turn_on() -> None:
    turns = WriteTurns()
    release = asyncio.Event()
    done: list[str] = []

    async def write(name: str) -> None:
        async with turns.turn():
            done.append(name)

    async def first() -> None:
        async with turns.turn():
            await release.wait()
            done.append("a")
        handed.cancel()  # c was handed the turn just now and has not run yet

    holder = asyncio.create_task(first())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(write("b"))
    handed = asyncio.create_task(write("c"))
    last = asyncio.create_task(write("d"))
    await asyncio.sleep(0)
    waiting.cancel()  # cancelled while waiting: skipped
    release.set()
    await holder
    await asyncio.wait_for(last, 1)
    assert done == ["a", "d"]
    assert waiting.cancelled() and handed.cancelled()
    async with asyncio.timeout(1), turns.turn():  # nobody holds it now
        pass
