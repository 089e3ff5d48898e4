"""Turning an append's body into log records: parse, validate, encode — optionally in a worker
process.

Validation and encoding are most of an append's CPU (pydantic builds every envelope, and each
record is encoded once), and the service's process also runs the HTTP server, the log's writer
and the projector under one GIL. ``Preparer`` can run this step in a process pool
(``serve --validation-workers N``) so that it gets a core of its own; small bodies stay inline,
where a round trip to the worker would cost more than it saves. On the 2-core machine of the
benchmarks a worker measured no faster (the round trip through ``ProcessPoolExecutor`` costs
several milliseconds, and the cores are busy anyway), so the default is inline.

The result is what ``Log.append`` would have produced — the same validation, the same record
per event, the same size limit — plus the few fields the fencing checks need.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

import orjson

from rolloutlog import errors
from rolloutlog.errors import InvalidEvent, InvalidRequest, PayloadTooLarge, RolloutlogError
from rolloutlog.log import (
    SERVICE_EVENT_TYPES,
    Record,
    encode_record,
    partition_for,
    validate_events,
)

__all__ = ["Batch", "Preparer", "parse_body", "prepare", "records"]

logger = logging.getLogger("rolloutlog.api")

NDJSON = "application/x-ndjson"
#: Bodies smaller than this are prepared inline (a worker round trip costs ~0.3 ms).
INLINE_BYTES = 8 * 1024


class Batch(NamedTuple):
    """A validated batch: per event its record's partition and value, and what fencing reads."""

    partitions: list[int]
    values: list[bytes]
    episodes: list[str]
    attempts: list[int]
    participants: list[tuple[str, int]]


def parse_body(body: bytes | bytearray, ndjson: bool) -> list[Any]:
    """The envelopes of a request body (still unvalidated)."""
    if ndjson:
        values: list[Any] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                values.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                index = len(values)
                raise InvalidEvent(
                    f"event {index}: not valid JSON: {e}",
                    index=index,
                    field="(envelope)",
                    reason=str(e),
                ) from e
        return values
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent(f"the body is not valid JSON: {e}", field="(body)", reason=str(e)) from e
    if not isinstance(value, list):
        raise InvalidRequest(
            "the body must be a JSON array of event envelopes (or NDJSON with "
            f"Content-Type: {NDJSON})",
            field="(body)",
        )
    return value


def prepare(body: bytes, ndjson: bool, partitions: int, max_record_bytes: int) -> Batch:
    """Parse, validate and encode a body; raise the refusal of its first bad event."""
    events = validate_events(parse_body(body, ndjson))
    batch = Batch([], [], [], [], [])
    for index, event in enumerate(events):
        if event.type in SERVICE_EVENT_TYPES or event.participant.kind == "service":
            raise InvalidEvent(
                f"event {index}: {event.type} events are written by the service only",
                index=index,
                field="type" if event.type in SERVICE_EVENT_TYPES else "participant.kind",
            )
        episode = event.episode
        assert episode is not None  # only service events have none
        value = encode_record(event)
        if len(value) > max_record_bytes:
            raise PayloadTooLarge(
                f"event {index} is {len(value)} bytes; the log accepts at most {max_record_bytes}",
                index=index,
                size=len(value),
                max_bytes=max_record_bytes,
            )
        batch.partitions.append(partition_for(episode, partitions))
        batch.values.append(value)
        batch.episodes.append(episode)
        batch.attempts.append(event.attempt)
        batch.participants.append((event.participant.id, event.participant.epoch))
    return batch


def _prepare_in_worker(
    body: bytes, ndjson: bool, partitions: int, max_record_bytes: int
) -> Batch | tuple[str, str, dict[str, Any]]:
    # An exception would cross the process boundary without its details: send them as data.
    try:
        return prepare(body, ndjson, partitions, max_record_bytes)
    except RolloutlogError as e:
        return (type(e).__name__, e.message, e.details)


def _refusal(name: str, message: str, details: dict[str, Any]) -> RolloutlogError:
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RolloutlogError)):
        cls = InvalidRequest
    error = cls(message)
    error.details = details
    return error


def _warm_up() -> None:
    """Build pydantic's validators in the worker before the first request needs them."""
    validate_events([])


class Preparer:
    """Prepares batches inline or in a pool of ``workers`` processes (0: always inline)."""

    def __init__(self, workers: int = 0) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        if self.workers > 0:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_warm_up,
            )

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    async def prepare(
        self, body: bytes, ndjson: bool, partitions: int, max_record_bytes: int
    ) -> Batch:
        pool = self._pool
        if pool is None or len(body) < INLINE_BYTES:
            return prepare(body, ndjson, partitions, max_record_bytes)
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                pool, _prepare_in_worker, body, ndjson, partitions, max_record_bytes
            )
        except BrokenProcessPool:
            logger.error("the validation worker died; validating in the service process")
            self._pool = None
            return prepare(body, ndjson, partitions, max_record_bytes)
        if isinstance(result, Batch):
            return result
        raise _refusal(*result)


def records(batch: Batch) -> Sequence[Record]:
    """The batch's log records (keyed by episode, as ``Log.append`` keys them)."""
    return [
        Record(partition, episode.encode(), value)
        for partition, episode, value in zip(
            batch.partitions, batch.episodes, batch.values, strict=True
        )
    ]
