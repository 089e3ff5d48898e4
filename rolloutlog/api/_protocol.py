"""uvicorn's httptools protocol with the service's edges: a header read timeout, a cap on open
connections with a reserve, a bounded time for the rest of a body the app did not read, and each
response's head written with its body.

uvicorn times out idle keep-alive connections only (``timeout_keep_alive``, armed after a
response): a connection that opens and sends nothing, or half of its headers, is held forever, and
neither uvicorn, h11 nor httptools offer a bound. This subclass arms a timer when a connection
opens and when a request's first byte arrives, and disarms it when the headers are complete; if
it fires the connection gets ``408`` and is closed. A stalled or trickled *body* is timed by the
app (``_app.BodyTimeout``), where the request is known; the rest of a body the app answered
without reading (a refusal, a route that takes none) is read and dropped for at most the header
timeout, then the connection is closed.

**The connection cap.** Every open connection holds a descriptor; at the open-file limit the
event loop cannot accept (libuv then accepts and drops what waits, which resets health checks).
So the service keeps at most ``max_connections`` open (``ConnectionCap``, by default half the
open-file limit) and keeps the last ``reserved`` of them for the routes that must answer under a
flood — ``/healthz``, ``/readyz`` and the trainer's checkpoints, restores and controller
(``RESERVED_PATHS``). Past ``max_connections - reserved`` a new connection is let in only to say
what it wants: a request for a reserved route is served, and the connection closed after its
response; any other request gets ``503 unavailable`` (``Retry-After: 1``) and is closed. When
the reserve itself is full, the oldest reserve connection that has not yet sent its headers is
the one closed (``503``): a flood of silent connections churns among itself, and a health check
that sends its request at once gets through. The listen backlog is a quarter of the descriptors
left above the cap (64 to 2048), so that what the loop accepts in one go never reaches the
limit.

uvicorn writes a response's status line and headers as soon as the app starts the response, and
its body when the app sends it: two ``send`` calls, and a client reading the reply wakes for the
head and again for the body. ``_HeadWithBody`` holds the head until the body's first part (or
the end of the event loop's turn, for a response whose body comes later) and writes both at once.
"""

from __future__ import annotations

import asyncio
import http
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rolloutlog.api._http import error_reply, send_error
from rolloutlog.errors import BackendUnavailable, RequestTimeout, RolloutlogError

__all__ = ["RESERVED_PATHS", "ConnectionCap", "connection_cap", "http_protocol", "reserved"]

#: The routes the reserve serves: the health checks, and the trainer's checkpoints, restores
#: and controller (every method, every path below them).
RESERVED_PATHS = re.compile(
    rb"/(?:healthz|readyz)|/v1/runs/[^/?]+/(?:checkpoints|restores|controller)(?:/[^?]*)?"
)
#: The listen backlog's bounds (``ConnectionCap.backlog``); uvicorn's default is the upper one.
MIN_BACKLOG = 64
MAX_BACKLOG = 2048


@dataclass(frozen=True)
class ConnectionCap:
    """At most ``max_connections`` open, the last ``reserved`` of them for ``RESERVED_PATHS``;
    ``backlog``: the listening socket's."""

    max_connections: int
    reserved: int
    backlog: int

    @property
    def unreserved(self) -> int:
        return self.max_connections - self.reserved


def connection_cap(nofile: int, max_connections: int | None, reserved: int) -> ConnectionCap:
    """The cap under an open-file limit of ``nofile``: ``max_connections`` (by default half the
    limit), a reserve of ``reserved`` (at most a quarter of the cap), and a backlog of a quarter
    of the descriptors left above the cap (the log, the catalog and the burst the loop accepts
    at once need them)."""
    cap = max_connections if max_connections is not None else max(1, nofile // 2)
    backlog = min(MAX_BACKLOG, max(MIN_BACKLOG, (nofile - cap) // 4))
    return ConnectionCap(cap, min(reserved, cap // 4), backlog)


def _response(error: RolloutlogError) -> bytes:
    """A whole ``connection: close`` response carrying ``error``'s envelope."""
    headers, body = error_reply(error, close=True)
    status = error.http_status
    lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _at_cap(cap: ConnectionCap) -> BackendUnavailable:
    return BackendUnavailable(
        f"the service holds {cap.unreserved} connections, the most it takes for this route "
        f"(the rest of its {cap.max_connections} are kept for health checks and trainers); "
        "retry shortly",
        max_connections=cap.max_connections,
        reserved_connections=cap.reserved,
        retry_after_s=1,
    )


@dataclass(eq=False)
class _Shared:
    """What one server's connections share (``http_protocol`` makes a class per server)."""

    header_timeout_s: float
    #: None: no cap.
    cap: ConnectionCap | None
    #: Called with the code of each refusal the protocol answers (the service's metrics).
    refused: Callable[[str], None] | None
    #: The connections let into the reserve that have not sent their headers yet, oldest first.
    waiting: dict[_Edges, None] = field(default_factory=dict)


class _Edges(HttpToolsProtocol):
    shared: ClassVar[_Shared] = _Shared(10.0, None, None)

    _header_timer: asyncio.TimerHandle | None = None
    _linger: asyncio.TimerHandle | None = None
    _reserve_only = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.shared.cap
        if cap is not None and len(self.connections) > cap.unreserved:
            self._reserve_only = True
            waiting = self.shared.waiting
            waiting[self] = None
            if len(self.connections) > cap.max_connections:
                # Connections closed but not yet gone count too: one in, one out.
                next(iter(waiting))._refuse(_at_cap(cap))
            if transport.is_closing():
                return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
        if self._reserve_only:
            self.shared.waiting.pop(self, None)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        reserve_only = self._reserve_only
        if reserve_only:
            shared = self.shared
            shared.waiting.pop(self, None)
            if shared.cap is not None and not reserved(self.url):
                self.app = _Refuse(_at_cap(shared.cap), shared.refused)
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # its task has not run yet
            if reserve_only:  # the reserve serves one request per connection
                cycle.keep_alive = False
            cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        cycle = self.cycle
        unread = cycle is not None and cycle.more_body and not self.pipeline
        super().on_response_complete()
        if unread and self._linger is None and not self.transport.is_closing():
            # Answered before its body was read (a refusal, a route that takes none): the rest
            # is read and dropped (closing at once would reset the answer away) for at most the
            # header timeout, then the connection is closed: a trickled body does not hold it.
            timeout_s = self.shared.header_timeout_s
            self._linger = self.loop.call_later(timeout_s, self.transport.close)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def _arm(self) -> None:
        if self._header_timer is None:
            timeout_s = self.shared.header_timeout_s
            self._header_timer = self.loop.call_later(timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        timeout_s = self.shared.header_timeout_s
        error = RequestTimeout(
            f"the request headers did not arrive within {timeout_s:g} s", timeout_s=timeout_s
        )
        self._refuse(error)

    def _refuse(self, error: RolloutlogError) -> None:
        """Answer ``error`` (when no response is being written here) and close."""
        self._disarm()
        self.shared.waiting.pop(self, None)
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            # No response is being written on this connection: there is room for ours.
            self.transport.write(_response(error))
            if self.shared.refused is not None:
                self.shared.refused(error.code)
        self.transport.close()


def reserved(target: bytes) -> bool:
    """Whether a request target (its path and query) is one the reserve serves."""
    return RESERVED_PATHS.fullmatch(target.split(b"?", 1)[0]) is not None


class _Refuse:
    """The ASGI app of a request the reserve does not serve: ``error``, then close."""

    __slots__ = ("_error", "_refused")

    def __init__(self, error: RolloutlogError, refused: Callable[[str], None] | None) -> None:
        self._error = error
        self._refused = refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send_error(send, self._error, close=True)
        if self._refused is not None:
            self._refused(self._error.code)


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


def http_protocol(
    header_timeout_s: float,
    cap: ConnectionCap | None = None,
    refused: Callable[[str], None] | None = None,
) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: this header timeout, this connection
    cap (None: none), ``refused`` called with the code of each refusal it answers."""
    shared = _Shared(header_timeout_s, cap, refused)
    return type("EdgesProtocol", (_Edges,), {"shared": shared})
