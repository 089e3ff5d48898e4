"""``plain_http_transport``: httpx over asyncio's socket calls, against a real socket server that
gives each answer a server can give (bodies chunked or sized, kept alive or closed while idle,
cut off, reset, stalled, never read), and the clients' choice of it."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from rolloutlog._plain_http import (
    LARGEST_READ,
    AsyncioStream,
    async_service_client,
    plain_http_transport,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

LIMITS = httpx.Limits(keepalive_expiry=2.0)


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port running ``handler`` per connection; yields its URL and the
    connections accepted so far (a list that grows)."""
    accepted: list[int] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def _request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=5.0, mounts={"http://": plain_http_transport(LIMITS)})


async def test_a_chunked_body_of_any_chunking_and_a_sized_one_arrive_whole() -> None:
    body = bytes(range(256)) * 80_000  # 20 MB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await _request(reader)
            if head.startswith(b"GET /sized"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                writer.write(body)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                position, size = 0, 1
                while position < len(body):
                    part = body[position : position + size]
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    position, size = position + len(part), size * 3 + 7
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with serving(handler) as (url, accepted), _client() as client:
        for path in ("/chunked", "/sized", "/chunked"):
            async with client.stream("GET", url + path) as response:
                assert isinstance(response.extensions["network_stream"], AsyncioStream)
                received = b"".join([chunk async for chunk in response.aiter_bytes()])
            assert received == body
        assert len(accepted) == 1  # one connection, kept alive


async def test_reads_grow_while_they_come_back_full_and_start_again_after_a_short_one() -> None:
    """A read that fills what it asked for asks four times as much next (up to
    ``LARGEST_READ``); a short one goes back to httpcore's size. Bytes arrive whole, in order."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    stream = AsyncioStream(ours)
    sent = bytes(range(256)) * (3 * LARGEST_READ // 256)
    writer = asyncio.create_task(asyncio.to_thread(theirs.sendall, sent))
    sizes: list[int] = []
    received = bytearray()
    try:
        while len(received) < len(sent):
            data = await stream.read(64 * 1024, timeout=5)
            sizes.append(len(data))
            received += data
        await writer
        assert received == sent
        assert max(sizes) > 64 * 1024  # it grew
        assert max(sizes) <= LARGEST_READ
        theirs.sendall(b"x" * 10)
        assert await stream.read(64 * 1024, timeout=5) == b"x" * 10  # short: back to 64 KB
        theirs.sendall(b"y" * (200 * 1024))
        await asyncio.sleep(0.05)
        assert len(await stream.read(64 * 1024, timeout=5)) == 64 * 1024
    finally:
        ours.close()
        theirs.close()


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # then closed, while the client keeps it

    async with serving(handler) as (url, accepted), _client() as client:
        for _ in range(3):
            response = await client.get(url)
            assert response.content == b"ok"
            await asyncio.sleep(0.05)
        assert len(accepted) == 3


async def test_refused_cut_off_reset_and_stalled_answers_are_httpx_errors() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    refused = f"http://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 1000)
        await writer.drain()
        if head.startswith(b"GET /reset"):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif head.startswith(b"GET /stall"):
            await asyncio.sleep(5)

    async with serving(handler) as (url, _), _client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(refused)
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/cut")
        with pytest.raises(httpx.ReadError):
            await client.get(url + "/reset")
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url + "/stall", timeout=0.3)


async def test_a_request_body_the_server_never_reads_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with serving(handler) as (url, _), _client() as client:
        with pytest.raises(httpx.WriteTimeout):
            await client.post(url, content=b"x" * (64 << 20), timeout=0.3)


async def test_the_clients_take_it_for_plain_http_only_and_not_through_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await _request(reader)
            line = head.split(b"\r\n", 1)[0]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(line), line))
            await writer.drain()

    async with serving(handler) as (url, _):
        async with async_service_client(url, 5.0) as client:
            response = await client.get("/v1/x")
            assert isinstance(response.extensions["network_stream"], AsyncioStream)
            assert response.content == b"GET /v1/x HTTP/1.1"
            # https stays on httpx's own transport: a TLS handshake (here left unanswered by a
            # plain server), not this transport's refusal to carry TLS.
            with pytest.raises((httpx.ConnectError, httpx.ConnectTimeout)) as raised:
                await client.get(url.replace("http://", "https://"), timeout=0.5)
            assert "carries no TLS" not in str(raised.value)
        monkeypatch.setenv("HTTP_PROXY", url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        async with async_service_client("http://service.invalid:8750", 5.0) as client:
            response = await client.get("/v1/x")  # to the proxy, in absolute form
            assert not isinstance(response.extensions["network_stream"], AsyncioStream)
            assert response.content == b"GET http://service.invalid:8750/v1/x HTTP/1.1"
