"""Turning an append's body into log records: parse, validate, encode — optionally in a worker
process.

Validation and encoding are most of an append's CPU (pydantic builds every envelope, and each
record is encoded once), and the service's process also runs the HTTP server, the log's writer
and the projector under one GIL. ``Preparer`` can run this step in worker processes
(``serve --validation-workers N``) so that it leaves the service process's GIL; small bodies stay
inline, where the round trip would cost more than it saves. A worker is spoken to over a socket
pair with asyncio streams: ``ProcessPoolExecutor`` was tried first and its management thread,
fighting for the busy process's GIL, made every round trip cost ~10 ms. On the 2-core benchmark
machine one worker added ~10-20% throughput but doubled the p99 latency at half load (the
worker, the service and the clients contend for two cores), so the default is inline; on a
machine with spare cores a worker takes validation off the service's GIL.

The result is what ``Log.append`` would have produced — the same validation, the same record
per event, the same size limit — plus the few fields the fencing checks need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import queue
import socket
import struct
import threading
from collections.abc import Sequence
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


_HEADER = struct.Struct("!Q")


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError
        received += count
    return bytes(buffer)


def _serve(sock: socket.socket) -> None:
    """A worker process: prepare each request it is sent, answer in order, over a socket.

    A reader thread drains the socket as soon as requests arrive, so that the service's writes
    never wait for this process to finish its current batch.
    """
    validate_events([])  # build pydantic's validators before the first request
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
                requests.put(_recv_exactly(sock, size))
        except (EOFError, OSError):
            requests.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (message := requests.get()) is not None:
        request_id, args = pickle.loads(message)
        reply = pickle.dumps((request_id, _prepare_in_worker(*args)), pickle.HIGHEST_PROTOCOL)
        try:
            sock.sendall(_HEADER.pack(len(reply)) + reply)
        except OSError:
            return


class _Worker:
    """One worker process, spoken to over a socket pair with asyncio streams (no threads here)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = socket.socketpair()
        self.process = context.Process(
            target=_serve, args=(theirs,), name="rolloutlog-validate", daemon=True
        )
        self.process.start()
        theirs.close()
        self.sock = ours
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.next_id = 0
        self.alive = False
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self.sock, limit=1 << 20)
        self._reading = asyncio.create_task(self._read(reader))
        self.alive = True

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                request_id, result = pickle.loads(await reader.readexactly(size))
                future = self.pending.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(result)
        except (asyncio.IncompleteReadError, OSError) as e:
            self._fail(e)

    async def submit(self, args: tuple[Any, ...]) -> Any:
        assert self._writer is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        request_id = self.next_id
        self.next_id += 1
        self.pending[request_id] = future
        message = pickle.dumps((request_id, args), pickle.HIGHEST_PROTOCOL)
        self._writer.write(_HEADER.pack(len(message)) + message)
        return await future

    def _fail(self, error: BaseException) -> None:
        self.alive = False
        for future in self.pending.values():
            if not future.done():
                future.set_exception(_WorkerDied(repr(error)))
        self.pending.clear()

    async def stop(self) -> None:
        self.alive = False
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reading
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)


class _WorkerDied(Exception):
    pass


class Preparer:
    """Prepares batches inline or in ``workers`` worker processes (0: always inline)."""

    def __init__(self, workers: int = 0) -> None:
        self.workers = workers
        self._pool: list[_Worker] = []
        self._turn = 0

    async def start(self) -> None:
        self._pool = [_Worker() for _ in range(self.workers)]
        for worker in self._pool:
            await worker.start()

    async def stop(self) -> None:
        pool, self._pool = self._pool, []
        for worker in pool:
            await worker.stop()

    async def prepare(
        self, body: bytes, ndjson: bool, partitions: int, max_record_bytes: int
    ) -> Batch:
        pool = [worker for worker in self._pool if worker.alive]
        if not pool or len(body) < INLINE_BYTES:
            return prepare(body, ndjson, partitions, max_record_bytes)
        self._turn += 1
        worker = min(pool, key=lambda w: (len(w.pending), (w.next_id + self._turn) % 7))
        try:
            result = await worker.submit((body, ndjson, partitions, max_record_bytes))
        except _WorkerDied as e:
            logger.error("a validation worker died (%s); validating in the service process", e)
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
