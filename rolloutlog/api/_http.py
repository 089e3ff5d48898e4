"""Response helpers: orjson bodies (opaque payloads embedded raw) and streamed NDJSON / JSON."""

from __future__ import annotations

import logging
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from rolloutlog.core import SPLICE_BYTES
from rolloutlog.errors import RolloutlogError
from rolloutlog.log import encode_opaque
from rolloutlog.wire import NDJSON

__all__ = [
    "JSON",
    "NDJSON",
    "dumps",
    "error_reply",
    "json_response",
    "send_error",
    "stream_json_object",
    "stream_ndjson",
    "stream_ndjson_lines",
    "wants_ndjson",
]

logger = logging.getLogger(__name__)

JSON = "application/json"


def _default(value: Any) -> Any:
    if isinstance(value, frozenset | set | tuple):
        return list(value)
    return encode_opaque(value)


def dumps(value: Any) -> bytes:
    """orjson, with ``Opaque`` payloads written as their raw bytes (never decoded)."""
    return orjson.dumps(value, default=_default)


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(dumps(content), status_code, headers=headers, media_type=JSON)


def error_reply(error: RolloutlogError, close: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of a reply carrying ``error``'s envelope, for the layers below the
    app's error handler (the body limit, the HTTP protocol): ``Retry-After`` when the error
    names one, ``Connection: close`` when asked."""
    body = dumps(error.to_dict())
    headers = [(b"content-type", JSON.encode()), (b"content-length", b"%d" % len(body))]
    retry_after = error.details.get("retry_after_s")
    if isinstance(retry_after, int):
        headers.append((b"retry-after", b"%d" % retry_after))
    if close:
        headers.append((b"connection", b"close"))
    return headers, body


async def send_error(
    send: Callable[[dict[str, Any]], Awaitable[None]], error: RolloutlogError, close: bool
) -> None:
    """Answer ``error`` through an ASGI ``send`` (``error_reply``'s headers and body)."""
    headers, body = error_reply(error, close)
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def wants_ndjson(request: Request) -> bool:
    """True when the client asks for NDJSON (``Accept: application/x-ndjson``)."""
    return NDJSON in request.headers.get("accept", "")


def _error_line(error: BaseException) -> bytes:
    """A stream cannot change its status once started: a failure becomes a last error line."""
    if isinstance(error, RolloutlogError):
        body = error.to_dict()
    else:
        logger.exception("stream failed", exc_info=error)
        body = {"error": {"code": "internal", "message": "the stream failed", "details": {}}}
    return dumps(body) + b"\n"


async def _each(items: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


#: How much NDJSON a streamed response writes at once.
_CHUNK_BYTES = 256 * 1024


def stream_ndjson(
    items: AsyncIterable[Any] | Iterable[Any],
    encode: Callable[[Any], Any] = lambda item: item,
    status_code: int = 200,
    on_close: Callable[[], None] | None = None,
) -> StreamingResponse:
    """One JSON value per line (from an async or a plain iterable); a failure mid-stream ends it
    with an ``{"error": …}`` line."""

    async def lines() -> AsyncIterator[bytes]:
        async for item in _each(items):
            yield dumps(encode(item)) + b"\n"

    return stream_ndjson_lines(lines(), status_code, on_close)


def stream_ndjson_lines(
    lines: AsyncIterable[bytes | memoryview],
    status_code: int = 200,
    on_close: Callable[[], None] | None = None,
) -> StreamingResponse:
    """NDJSON already encoded, as lines (each ending with a newline) or the pieces of lines
    (``ProjectionLine.pieces``), spliced into chunks as they come. A piece of ``SPLICE_BYTES``
    or more (a large opaque state, a piece of its own in its line) is a chunk of its own,
    written as it is rather than copied into a joined one. A failure mid-stream ends it with an
    ``{"error": …}`` line."""

    async def body() -> AsyncIterator[bytes | memoryview]:
        buffer: list[bytes | memoryview] = []
        size = 0
        try:
            async for line in lines:
                if len(line) >= SPLICE_BYTES:
                    if buffer:
                        yield b"".join(buffer)
                        buffer.clear()
                        size = 0
                    yield line
                    continue
                buffer.append(line)
                size += len(line)
                if size >= _CHUNK_BYTES:
                    yield b"".join(buffer)
                    buffer.clear()
                    size = 0
            if buffer:
                yield b"".join(buffer)
        except Exception as e:  # reported in-band: the status line has gone already
            if buffer:
                yield b"".join(buffer)
            yield _error_line(e)
        finally:
            if on_close is not None:
                on_close()

    return StreamingResponse(body(), status_code=status_code, media_type=NDJSON)


def stream_json_object(
    head: Mapping[str, Any],
    key: str,
    items: AsyncIterator[Any],
    encode: Callable[[Any], Any] = lambda item: item,
    status_code: int = 200,
) -> StreamingResponse:
    """``{**head, key: [items…]}`` written as it is produced (constant memory).

    A failure mid-stream truncates the document, so the client's JSON parser fails rather than
    reading a partial list as a whole one.
    """

    async def body() -> AsyncIterator[bytes]:
        opening = dumps({**head, key: []})
        yield opening[:-2]  # drop the closing "]}"
        first = True
        buffer: list[bytes] = []
        size = 0
        async for item in items:
            piece = dumps(encode(item))
            buffer.append(piece if first else b"," + piece)
            first = False
            size += len(piece)
            if size >= 64 * 1024:
                yield b"".join(buffer)
                buffer.clear()
                size = 0
        buffer.append(b"]}")
        yield b"".join(buffer)

    return StreamingResponse(body(), status_code=status_code, media_type=JSON)
