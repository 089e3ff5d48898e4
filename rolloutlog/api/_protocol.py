"""uvicorn's httptools protocol with a header read timeout.

uvicorn times out idle keep-alive connections only (``timeout_keep_alive``, armed after a
response): a connection that opens and sends nothing, or half of its headers, is held forever, and
neither uvicorn, h11 nor httptools offer a bound. This subclass arms a timer when a connection
opens and when a request's first byte arrives, and disarms it when the headers are complete; if
it fires the connection gets ``408`` and is closed. A stalled *body* is timed by the app
(``_app.BodyTimeout``), where the request is known.
"""

from __future__ import annotations

import asyncio

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
        super().on_headers_complete()

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


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with this header timeout."""
    return type("TimedHeadersProtocol", (_TimedHeaders,), {"header_timeout_s": header_timeout_s})
