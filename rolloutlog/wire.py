"""What the service and its HTTP clients (the trainer's, the participant SDK's) agree on besides
the routes: where the service listens by default and the media type of its streams. Error replies
are turned back into their classes by ``rolloutlog.errors.error_from_wire``."""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from collections.abc import Sequence

__all__ = [
    "CLIENT_KEEPALIVE_S",
    "DEFAULT_URL",
    "NDJSON",
    "SERVICE_KEEPALIVE_S",
    "NdjsonSplitter",
    "direct_http_url",
    "service_urls",
]

#: The service's address when neither the caller nor ``ROLLOUTLOG_URL`` names one.
DEFAULT_URL = "http://127.0.0.1:8750"
#: Newline-delimited JSON: event batches in, episode and projection streams out.
NDJSON = "application/x-ndjson"
#: How long the service keeps an idle keep-alive connection open (uvicorn's
#: ``timeout_keep_alive``, armed when a response is sent).
SERVICE_KEEPALIVE_S = 5
#: How long the service's clients keep an idle connection for reuse: well below
#: ``SERVICE_KEEPALIVE_S``. A client that reuses a connection the service is closing at that very
#: moment sends its request into a closed socket (a reset, or an end without a reply: nothing
#: says whether the request was taken); httpx's own default (5 s) equals the service's, and
#: since the client's clock starts when the reply arrives, after the service's, it reused
#: connections in exactly that window (measured with the service busy: 3 of 40 requests sent
#: after 4.95-5.05 s idle failed, none at 2 s).
CLIENT_KEEPALIVE_S = 2.0


def service_urls(url: str | Sequence[str] | None) -> tuple[str, ...]:
    """The service URLs: ``url`` (one, a comma-separated list, or a list), else
    ``ROLLOUTLOG_URL`` (likewise), else ``DEFAULT_URL``; without trailing slashes."""
    given: str | Sequence[str] = url or os.environ.get("ROLLOUTLOG_URL") or DEFAULT_URL
    parts = given.split(",") if isinstance(given, str) else list(given)
    urls = tuple(part.strip().rstrip("/") for part in parts if part.strip())
    return urls or (DEFAULT_URL,)


class NdjsonSplitter:
    """Splits a streamed NDJSON body into its lines as the chunks arrive.

    A restore's projections are ~100 MB of NDJSON for 16,000 episodes (350 MB for 1,000 large
    session states): orjson parses bytes and memoryviews, so each line inside a chunk is a view
    of it, neither copied nor decoded to text and split again (what ``httpx``'s ``aiter_lines``
    does); only a line cut across chunks is joined, once, from views of the chunks it spans.
    Blank lines are dropped."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []

    def feed(self, chunk: bytes) -> list[bytes | memoryview]:
        """The lines this chunk completes (views of it, valid while it is)."""
        end = chunk.find(b"\n")
        if end < 0:
            if chunk:
                self._parts.append(chunk)
            return []
        view = memoryview(chunk)
        lines: list[bytes | memoryview] = []
        if self._parts:
            self._parts.append(view[:end])
            lines.append(b"".join(self._parts))
            self._parts.clear()
        else:
            lines.append(view[:end])
        start = end + 1
        end = chunk.find(b"\n", start)
        while end >= 0:
            lines.append(view[start:end])
            start = end + 1
            end = chunk.find(b"\n", start)
        if start < len(chunk):
            self._parts.append(view[start:])
        return [line for line in lines if not _blank(line)]

    def end(self) -> list[bytes]:
        """The last line, when the body does not end with a newline."""
        rest = b"".join(self._parts)
        self._parts.clear()
        return [] if _blank(rest) else [rest]


def _blank(line: bytes | memoryview) -> bool:
    """Empty or only whitespace (a JSON value starts with none: only such lines are copied to
    be checked)."""
    return not line or (line[0] in b" \t\r\n" and bytes(line).isspace())


def direct_http_url(url: str) -> bool:
    """Whether requests to ``url`` go straight to it (http/https, no proxy configured for it),
    which is the only case the lean connection handles; otherwise the transport uses httpx."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    proxies = urllib.request.getproxies_environment()
    if parts.scheme in proxies or "all" in proxies:
        return bool(urllib.request.proxy_bypass(parts.hostname))
    return True
