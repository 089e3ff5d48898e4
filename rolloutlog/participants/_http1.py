"""A lean keep-alive HTTP/1.1 connection for the HTTP transport's event appends.

One coalesced append is one ``POST`` on one connection (the transport sends one request at a
time), so a general client's machinery — a pool, locks (each one's setup tried ``import sniffio``,
absent here, through the whole import path), per-request header models, hooks — is all overhead:
with httpx, a request of 200 events cost the participant ~1 ms of CPU, about 5 us per event on
an idle machine, more than the rest of the SDK's pipeline. This sends a prebuilt header block and the body in one write and parses the status line, the
headers it needs (``content-length``, ``transfer-encoding: chunked``, ``connection: close``) and
the body. Every connection problem is ``BackendUnavailable`` (retriable): the transport sends the
same request again, which the log folds once (``seq``). A connection idle longer than
``CLIENT_KEEPALIVE_S`` is closed rather than reused (the service closes idle ones after
``SERVICE_KEEPALIVE_S``: one reused at that moment would be reset under the request), and a
reused connection that ended or was reset before the first byte of the reply (the server
closed it while idle) is reopened at once for the same request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping

from rolloutlog.errors import BackendUnavailable
from rolloutlog.wire import CLIENT_KEEPALIVE_S

__all__ = ["Http1Connection"]

_MAX_HEAD = 64 * 1024


class _Stale(Exception):
    """A reused connection ended, or was reset, before the first byte of the reply."""


class Http1Connection:
    """One HTTP/1.1 connection to ``url``; ``post`` returns (status, body)."""

    def __init__(self, url: str, headers: Mapping[str, str], timeout_s: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        authority = parts.netloc.rsplit("@", 1)[-1]
        lines = [f"Host: {authority}", "Accept: application/json"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        self._headers = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        #: When the connection's last reply was read (``time.monotonic``).
        self._idle_since = 0.0

    async def post(self, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        head = b"POST %b HTTP/1.1\r\n%bContent-Type: %b\r\nContent-Length: %d\r\n\r\n" % (
            (self.prefix + path).encode(),
            self._headers,
            content_type.encode(),
            len(body),
        )
        if self._writer is not None and time.monotonic() - self._idle_since > CLIENT_KEEPALIVE_S:
            self.close()  # the service may be closing it right now
        while True:
            reused = self._writer is not None
            try:
                async with asyncio.timeout(self.timeout_s):
                    if self._writer is None:
                        await self._connect()
                    return await self._exchange(head, body)
            except _Stale as e:
                self.close()
                if reused:
                    continue  # closed while idle: the same request on a new connection
                raise BackendUnavailable(f"{self.host}:{self.port} closed the connection") from e
            except (
                OSError,
                ValueError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ) as e:
                self.close()
                raise BackendUnavailable(f"the service did not answer: {e!r}") from e
            except TimeoutError as e:
                self.close()
                raise BackendUnavailable(f"no reply within {self.timeout_s} s") from e
            except BaseException:
                self.close()  # cancelled mid-exchange: the connection's state is unknown
                raise

    async def _connect(self) -> None:
        context = ssl.create_default_context() if self.tls else None
        self._reader, self._writer = await asyncio.open_connection(
            self.host, self.port, ssl=context, limit=_MAX_HEAD
        )

    async def _exchange(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        try:
            writer.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                writer.write(body)
            await writer.drain()
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _Stale() from e
            raise
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _Stale() from e
        while True:
            status, fields = _parse_head(raw)
            if status >= 200:
                break  # 1xx (never asked for) are skipped
            raw = await reader.readuntil(b"\r\n\r\n")
        if fields.get("transfer-encoding", "").lower() == "chunked":
            content = await _read_chunked(reader)
        elif "content-length" in fields:
            content = await reader.readexactly(int(fields["content-length"]))
        else:
            content = await reader.read()
            fields["connection"] = "close"
        if fields.get("connection", "").lower() == "close" or raw.startswith(b"HTTP/1.0"):
            self.close()
        self._idle_since = time.monotonic()
        return status, content

    def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.transport.abort()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1 reply: {lines[0][:80]!r}")
    status = int(rest[:3])
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return status, fields


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
