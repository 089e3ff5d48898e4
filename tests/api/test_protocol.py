"""``_protocol``: a response's head goes out with its body, in one write."""

from __future__ import annotations

import asyncio
from typing import Any

from rolloutlog.api._protocol import _HeadWithBody


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return name


async def test_the_head_is_written_with_the_first_part_of_the_body() -> None:
    transport = _Transport()
    held = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    held.write(b"head ")
    assert transport.writes == []
    held.write(b"body")
    held.write(b" more")
    assert transport.writes == [b"head body", b" more"]
    await asyncio.sleep(0)
    assert transport.writes == [b"head body", b" more"]
    assert held.get_extra_info("peername") == "peername"


async def test_a_head_whose_body_comes_later_goes_out_at_the_end_of_the_turn() -> None:
    transport = _Transport()
    held = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    held.write(b"head")
    await asyncio.sleep(0)
    assert transport.writes == [b"head"]
    held.write(b"body")
    assert transport.writes == [b"head", b"body"]


async def test_closing_writes_a_held_head_first() -> None:
    transport = _Transport()
    held = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
    held.write(b"head")
    held.close()
    assert transport.writes == [b"head"] and transport.closed
    await asyncio.sleep(0)
    assert transport.writes == [b"head"]
