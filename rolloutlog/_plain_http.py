"""The async clients' transport for plain ``http://`` URLs: httpx and httpcore as they are, over
an httpcore network backend that reads and writes the socket with asyncio's own socket calls.

httpcore's default backend (anyio) spends more than the reads themselves on each 64 KB read of a
large stream: a cancel scope per read, the socket paused and resumed around each wait, and each
256 KB chunk asyncio received split again by copying what is left. Measured on this project's
largest answers, a restore's projection stream read whole with ``aiter_bytes`` (client CPU, same
service, same run): S2's 350 MB 391-433 ms over anyio against 226-309 ms here; S1's 86 MB
99-115 ms against 57-72 ms. TLS (``https://``) stays on httpx's own transport: only plain TCP is
read here, so no handshake, certificate or ALPN logic is written twice.

httpcore asks for 64 KB a read. A read that comes back full means more is waiting, so the next
asks for four times as much, up to ``LARGEST_READ``; one that comes back short starts again at
what httpcore asks. A small answer reads as before; a large stream goes through h11 in a
sixteenth of the steps. Measured on S2's stream from a server that writes it at once (client
CPU, five runs each): ~445-470 ms with 64 KB reads, ~310-335 ms with reads grown to 1 MB. (At
2 MB a read it was ~510 ms: the buffers no longer come back to the same memory.)
"""

# httpcore's network interface passes each call's ``timeout``: kept as it names it.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx
from httpcore import (
    ConnectError,
    ConnectTimeout,
    ReadError,
    ReadTimeout,
    WriteError,
    WriteTimeout,
)

from rolloutlog.wire import CLIENT_KEEPALIVE_S, direct_http_url

__all__ = ["async_service_client", "plain_http_transport"]

#: Where httpx keeps a transport's connection pool (``httpx.AsyncHTTPTransport``); the pin on
#: httpx in pyproject.toml holds it, and tests/test_plain_http.py checks that it is there.
_POOL = "_pool"
#: The most one read of a large stream asks for (see the module's docstring).
LARGEST_READ = 1024 * 1024


def async_service_client(
    url: str, timeout_s: float, *, base_url: str | None = None
) -> httpx.AsyncClient:
    """The SDK's and the trainer's async client of the service at ``url`` (its base URL unless
    ``base_url`` says otherwise): idle connections kept ``CLIENT_KEEPALIVE_S``, plain
    ``http://`` through ``plain_http_transport`` when requests go straight to the service
    (``direct_http_url``: no proxy in the environment for it; else httpx routes them)."""
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
    mounts = {"http://": plain_http_transport(limits)} if direct_http_url(url) else {}
    return httpx.AsyncClient(
        base_url=url if base_url is None else base_url,
        timeout=timeout_s,
        limits=limits,
        mounts=mounts,
    )


def plain_http_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's transport for ``http://`` URLs (mount it there), with ``limits``, whose pool
    reads and writes with asyncio's socket calls (``AsyncioBackend``)."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    if not isinstance(getattr(transport, _POOL, None), httpcore.AsyncConnectionPool):
        return transport  # another httpx: its own backend, as without this module
    pool = httpcore.AsyncConnectionPool(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    setattr(transport, _POOL, pool)
    return transport


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Plain TCP connections read and written with ``loop.sock_recv`` / ``sock_sendall``."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        try:
            async with asyncio.timeout(timeout):
                addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                for family, kind, proto, _, address in addresses:
                    sock = socket.socket(family, kind, proto)
                    try:
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        for option in socket_options or ():
                            sock.setsockopt(*option)
                        if local_address is not None:
                            sock.bind((local_address, 0))
                        await loop.sock_connect(sock, address)
                    except OSError as e:
                        sock.close()
                        error = e
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    return AsyncioStream(sock)
        except TimeoutError as e:
            raise ConnectTimeout(str(e)) from e
        except OSError as e:  # name resolution
            raise ConnectError(str(e)) from e
        raise ConnectError(str(error or f"no address for {host!r}"))

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - the clients never ask
        raise ConnectError("plain_http_transport connects over TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connected non-blocking socket. A read or write tries the socket at once and waits
    (under its timeout) only when it would block."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        #: What the next read asks for beyond httpcore's ``max_bytes`` (0: just that).
        self._grown = 0

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Up to ``max_bytes``, or more after a read that came back full (the module's
        docstring)."""
        size = max(max_bytes, self._grown)
        data = await self._recv(size, timeout)
        self._grown = min(size * 4, LARGEST_READ) if len(data) == size else 0
        return data

    async def _recv(self, size: int, timeout: float | None) -> bytes:
        try:
            return self._sock.recv(size)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            raise ReadError(str(e)) from e
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.get_running_loop().sock_recv(self._sock, size)
        except TimeoutError as e:
            raise ReadTimeout(str(e)) from e
        except OSError as e:
            raise ReadError(str(e)) from e

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_sendall(self._sock, buffer)
        except TimeoutError as e:
            raise WriteTimeout(str(e)) from e
        except OSError as e:
            raise WriteError(str(e)) from e

    async def aclose(self) -> None:
        self._sock.close()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - mounted for http:// only
        raise ConnectError("plain_http_transport carries no TLS (https uses httpx's own)")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._sock
        if info == "is_readable":
            # An idle keep-alive connection with something to read (the server's close, mostly)
            # is not reused.
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
            except (OSError, ValueError):
                return True
            return bool(readable)
        if info == "client_addr":
            return self._sock.getsockname()
        if info == "server_addr":
            return self._sock.getpeername()
        return None
