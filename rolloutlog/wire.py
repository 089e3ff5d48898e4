"""What the service and its HTTP clients (the trainer's, the participant SDK's) agree on besides
the routes: where the service listens by default and the media type of its streams. Error replies
are turned back into their classes by ``rolloutlog.errors.error_from_wire``."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = [
    "CLIENT_KEEPALIVE_S",
    "DEFAULT_URL",
    "NDJSON",
    "SERVICE_KEEPALIVE_S",
    "NdjsonSplitter",
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
    """Splits a streamed NDJSON body into its lines as bytes, as the chunks arrive.

    A restore's projections are ~100 MB of NDJSON for 16,000 episodes: orjson parses bytes, so
    the lines are cut from the bytes as they are, never decoded to text and split again (what
    ``httpx``'s ``aiter_lines`` does). Blank lines are dropped."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines this chunk completes."""
        if b"\n" not in chunk:
            if chunk:
                self._parts.append(chunk)
            return []
        lines = chunk.split(b"\n")
        if self._parts:
            self._parts.append(lines[0])
            lines[0] = b"".join(self._parts)
            self._parts.clear()
        tail = lines.pop()
        if tail:
            self._parts.append(tail)
        return [line for line in lines if line and not line.isspace()]

    def end(self) -> list[bytes]:
        """The last line, when the body does not end with a newline."""
        rest = b"".join(self._parts)
        self._parts.clear()
        return [rest] if rest and not rest.isspace() else []
