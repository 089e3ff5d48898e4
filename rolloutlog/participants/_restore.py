"""Restore helpers: what a replacement attempt needs from a restore, in bulk or one at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import httpx
import orjson

from rolloutlog._telemetry import client_span
from rolloutlog.errors import (
    BackendUnavailable,
    UnknownEpisode,
    error_from_body,
    error_from_wire,
)
from rolloutlog.participants._transport import _Rest
from rolloutlog.wire import NDJSON, NdjsonSplitter

__all__ = ["Restores"]


def _value(line: bytes | memoryview) -> dict[str, Any]:
    """One projection line; an in-band ``{"error": …}`` line (the stream failed) is raised."""
    value: dict[str, Any] = orjson.loads(line)
    if isinstance(value, dict) and set(value) == {"error"}:
        raise error_from_body(200, value)
    return value


class Restores:
    """Projections of a restore, over the service's REST routes.

    - ``install``: every continued episode's projection for one participant, one NDJSON stream
      (``GET /v1/runs/{run}/restores/{id}/projections?kind=&participant=``), e.g. a policy server
      restoring all its ledgers at start;
    - ``fetch``: one episode's projection when its replacement attempt arrives
      (``GET /v1/runs/{run}/episodes/{episode}/projection?restore=ID``).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._rest = _Rest(url, token, client)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._rest.close()

    async def install(
        self,
        run: str,
        restore_id: int,
        *,
        kind: str | None = None,
        participant: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream the restore's projections that hold something for this participant."""
        params = {k: v for k, v in (("kind", kind), ("participant", participant)) if v}
        rest = self._rest
        headers = {**rest.headers, "Accept": NDJSON}
        path = f"/v1/runs/{run}/restores/{restore_id}/projections"
        try:
            async with (
                client_span("GET", path, headers) as traced,
                rest.client.stream(
                    "GET", rest.prefix + path, params=params, headers=traced
                ) as response,
            ):
                if response.is_error:
                    await response.aread()
                    raise error_from_wire(response.status_code, response.content)
                lines = NdjsonSplitter()
                async for chunk in response.aiter_bytes():
                    for line in lines.feed(chunk):
                        yield _value(line)
                for line in lines.end():
                    yield _value(line)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"the service did not answer: {e!r}") from e

    async def pending_exports(
        self, run: str, participant: str, *, wait_s: float = 20.0
    ) -> dict[str, Any] | None:
        """The pending checkpoint's sessions that wait for an export by ``participant``
        (``GET /v1/runs/{run}/checkpoints/pending/exports``, a long poll of up to ``wait_s``):
        ``{"checkpoint_id", "deadline_at", "sessions": [{"episode", "attempt", "capture_key",
        "session_id"}]}``, or None when no checkpoint waited for one in that time."""
        response = await self._rest.request(
            "GET",
            f"/v1/runs/{run}/checkpoints/pending/exports",
            params={"participant": participant, "wait_s": wait_s},
            timeout=wait_s + 10.0,
        )
        if response.status_code == 204:
            return None
        result: dict[str, Any] = orjson.loads(response.content)
        return result

    async def fetch(self, run: str, episode: str, restore: int | str = "latest") -> dict[str, Any]:
        """One episode's projection as the restore continues it (``UnknownEpisode`` when the
        restore restarted or excluded it: ``details`` say which)."""
        response = await self._rest.request(
            "GET", f"/v1/runs/{run}/episodes/{episode}/projection", params={"restore": restore}
        )
        result: dict[str, Any] = orjson.loads(response.content)
        return result

    async def continued(
        self, run: str, episode: str, restore: int | str = "latest", *, deadline_s: float = 120.0
    ) -> dict[str, Any] | None:
        """``fetch``, or None when the restore did not continue the episode (restarted or
        excluded it); rides through a service restart for up to ``deadline_s``, as the
        transports' appends do."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        failures = 0
        while True:
            try:
                return await self.fetch(run, episode, restore)
            except UnknownEpisode:
                return None
            except BackendUnavailable:
                failures += 1
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(min(2.0, 0.05 * 2**failures))
