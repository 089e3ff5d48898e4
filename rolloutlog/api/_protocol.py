"""uvicorn's httptools protocol with a header read timeout, writing each response's head with its
body.

uvicorn times out idle keep-alive connections only (``timeout_keep_alive``, armed after a
response): a connection that opens and sends nothing, or half of its headers, is held forever, and
neither uvicorn, h11 nor httptools offer a bound. This subclass arms a timer when a connection
opens and when a request's first byte arrives, and disarms it when the headers are complete; if
it fires the connection gets ``408`` and is closed. A stalled *body* is timed by the app
(``_app.BodyTimeout``), where the request is known.

uvicorn writes a response's status line and headers as soon as the app starts the response, and
its body when the app sends it: two ``send`` calls, and a client reading the reply wakes for the
head and again for the body. ``_HeadWithBody`` holds the head until the body's first part (or
the end of the event loop's turn, for a response whose body comes later) and writes both at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rolloutlog.api._http import dumps
from rolloutlog.errors import RequestTimeout

__all__ = ["http_protocol"]


class _TimedHeaders(HttpToolsProtocol):
    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # its task has not run yet
            cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            # No response is being written on this connection: there is room for ours.
            error = RequestTimeout(
                f"the request headers did not arrive within {self.header_timeout_s:g} s",
                timeout_s=self.header_timeout_s,
            )
            body = dumps(error.to_dict())
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()


class _HeadWithBody:
    """The connection as one response sees it: its first write (the head) is held until its
    next (the body's first part) and goes out with it, or alone at the end of the loop's turn."""

    __slots__ = ("_first", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self._flush)
            return
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with this header timeout."""
    return type("TimedHeadersProtocol", (_TimedHeaders,), {"header_timeout_s": header_timeout_s})
