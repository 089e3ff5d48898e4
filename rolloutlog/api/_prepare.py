"""Turning an append's body into log records: parse, validate, encode — optionally in a worker
process.

Each envelope is checked and encoded by the fast path (``log.fast_record``: a client envelope
of plain JSON types straight to its record, 2-3x cheaper than pydantic) or, for anything it does
not take, by the pydantic models, which give every refusal. In the append benchmark validation
and encoding were ~44% of the service's main-thread CPU before the fast path, ~28% after (the
process also runs the HTTP server, the log's writer and the projector, under one GIL).
``Preparer`` can run this step in worker processes (``serve --validation-workers N``) so that it
leaves the service process's GIL; small bodies stay inline, where the round trip would cost more
than it saves. A worker is spoken to over a socket pair with asyncio streams:
``ProcessPoolExecutor`` was tried first and its management thread, fighting for the busy
process's GIL, made every round trip cost ~10 ms. On the 2-core benchmark machine one worker
(measured before the fast path) added ~10-20% throughput but doubled the p99 latency at half
load (the worker, the service and the clients contend for two cores), so the default is inline;
on a machine with spare cores a worker takes validation off the service's GIL.

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
import re
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

import orjson

from rolloutlog import errors
from rolloutlog.errors import InvalidEvent, InvalidRequest, RolloutlogError
from rolloutlog.log import (
    SERVICE_EVENT_TYPES,
    Record,
    check_record_size,
    encode_record,
    fast_record,
    partition_for,
    validate_event,
    validate_events,
)
from rolloutlog.wire import NDJSON

__all__ = [
    "Batch",
    "FenceKey",
    "Preparer",
    "parse_body",
    "prepare",
    "prepare_sliced",
    "records",
    "records_sliced",
    "release",
]

logger = logging.getLogger("rolloutlog.api")

#: Bodies smaller than this are prepared inline (a worker round trip costs ~0.3 ms).
INLINE_BYTES = 8 * 1024


#: (episode, attempt, participant id, epoch): what fencing checks, once per distinct key.
FenceKey = tuple[str, int, str, int]


class Batch(NamedTuple):
    """A validated batch: per event its record's partition and value, and what fencing reads."""

    partitions: list[int]
    values: list[bytes]
    episodes: list[str]
    #: Each distinct fencing key with the index of its first event (fencing checks a 200,000-event
    #: batch of one participant once, not 200,000 times).
    keys: dict[FenceKey, int]
    #: Per (participant id, epoch): the lowest and highest ``seq`` and the index of the highest.
    seqs: dict[tuple[str, int], tuple[int, int, int]]


def _new_batch() -> Batch:
    return Batch([], [], [], {}, {})


def _ndjson_value(line: bytes | bytearray, index: int) -> Any:
    """One NDJSON line's envelope, or the refusal of event ``index`` as not JSON."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent(
            f"event {index}: not valid JSON: {e}",
            index=index,
            field="(envelope)",
            reason=str(e),
        ) from e


def _body_not_json(e: orjson.JSONDecodeError) -> InvalidEvent:
    return InvalidEvent(f"the body is not valid JSON: {e}", field="(body)", reason=str(e))


def parse_body(body: bytes | bytearray, ndjson: bool) -> list[Any]:
    """The envelopes of a request body (still unvalidated)."""
    if ndjson:
        values: list[Any] = []
        for line in body.splitlines():
            if line.strip():
                values.append(_ndjson_value(line, len(values)))
        return values
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise _body_not_json(e) from e
    if not isinstance(value, list):
        raise InvalidRequest(
            "the body must be a JSON array of event envelopes (or NDJSON with "
            f"Content-Type: {NDJSON})",
            field="(body)",
        )
    return value


def _slow_record(value: Any, index: int) -> tuple[bytes, str, int, str, int, int]:
    """What ``fast_record`` gives, for an envelope it did not take: by the models, which also
    give every refusal."""
    event = validate_event(value, index)
    if event.type in SERVICE_EVENT_TYPES or event.participant.kind == "service":
        raise InvalidEvent(
            f"event {index}: {event.type} events are written by the service only",
            index=index,
            field="type" if event.type in SERVICE_EVENT_TYPES else "participant.kind",
        )
    assert event.episode is not None  # only service events have none
    who = event.participant
    return encode_record(event), event.episode, event.attempt, who.id, who.epoch, event.seq


def _add_all(
    batch: Batch, values: list[Any], first: int, partitions: int, max_record_bytes: int
) -> None:
    """Validate envelopes and add their records to the batch (``first``: the index of
    ``values[0]`` in the body): by the fast path when it takes an envelope, else by the models.
    One loop with its lookups hoisted: it runs for every event of every append."""
    add_partition = batch.partitions.append
    add_value = batch.values.append
    add_episode = batch.episodes.append
    keys = batch.keys
    seqs = batch.seqs
    for index, value in enumerate(values, first):
        fast = fast_record(value)
        record, episode, attempt, participant, epoch, seq = (
            _slow_record(value, index) if fast is None else fast
        )
        if len(record) > max_record_bytes:
            check_record_size(len(record), max_record_bytes, index=index)
        add_partition(partition_for(episode, partitions))
        add_value(record)
        add_episode(episode)
        key = (episode, attempt, participant, epoch)
        if key not in keys:
            keys[key] = index
        who = (participant, epoch)
        seen = seqs.get(who)
        if seen is None:
            seqs[who] = (seq, seq, index)
        elif seq < seen[0] or seq > seen[1]:
            low, high, at = seen
            seqs[who] = (min(low, seq), max(high, seq), index if seq > high else at)


def prepare(body: bytes, ndjson: bool, partitions: int, max_record_bytes: int) -> Batch:
    """Parse, validate and encode a body; raise the refusal of its first bad event."""
    batch = _new_batch()
    _add_all(batch, parse_body(body, ndjson), 0, partitions, max_record_bytes)
    return batch


# -- big bodies, in slices ---------------------------------------------------------------------
#
# A 32 MiB body of tiny events is ~190,000 envelopes: parsing it in one orjson call and validating
# it in one loop held the event loop for seconds (``/healthz`` included). Bodies over
# ``SLICED_BYTES`` are parsed a slice at a time and validated a few milliseconds at a time, with
# the loop let through in between; the result and every refusal are those of ``prepare``.

#: Bodies at least this big are prepared in slices.
SLICED_BYTES = 1 << 20
#: Longest stretch of work between two yields to the event loop.
SLICE_S = 0.002
#: Bytes of a JSON array parsed per orjson call.
SLICE_BYTES = 128 * 1024
#: Where a top-level array of envelopes can split: between two objects. A match inside a string
#: or a nested value makes that slice fail to parse, and the slice grows to the next match.
_BOUNDARY = re.compile(rb"\}[ \t\n\r]*,[ \t\n\r]*\{")
#: Failed split attempts (a nested ``},{``) before the rest is parsed in one call.
_SPLIT_ATTEMPTS = 4


class _Yielder:
    """Lets the event loop run once ``SLICE_S`` of work has passed since it last did."""

    def __init__(self) -> None:
        self.deadline = time.perf_counter() + SLICE_S

    async def __call__(self) -> None:
        if time.perf_counter() >= self.deadline:
            await asyncio.sleep(0)
            self.deadline = time.perf_counter() + SLICE_S


async def _parse_array_sliced(body: bytes, pause: _Yielder) -> list[Any]:
    """``orjson.loads`` of a JSON array, a slice of elements at a time.

    A slice runs from a top-level element's start to just before a comma; if ``[slice]`` parses,
    the comma is a top-level one (the parser's state after the slice is the same as in the whole
    body), so the elements are exactly those the whole parse would give.
    """
    start = len(body) - len(body.lstrip())
    if not body.startswith(b"[", start):
        return parse_body(body, False)  # not an array: the one-call parse says why
    values: list[Any] = []
    position = start + 1
    failures = 0
    search = position + SLICE_BYTES
    while failures < _SPLIT_ATTEMPTS:
        match = _BOUNDARY.search(body, search)
        if match is None:
            break
        cut = match.start() + 1
        try:
            values.extend(orjson.loads(b"[" + body[position:cut] + b"]"))
        except orjson.JSONDecodeError:
            failures += 1
            search = cut
            continue
        failures = 0
        position = body.index(b",", cut) + 1
        search = position + SLICE_BYTES
        await pause()
    try:
        values.extend(orjson.loads(b"[" + body[position:]))
    except orjson.JSONDecodeError as e:
        raise _body_not_json(e) from e
    return values


async def _parse_ndjson_sliced(body: bytes, pause: _Yielder) -> list[Any]:
    values: list[Any] = []
    for line in body.splitlines():
        if not line.strip():
            continue
        values.append(_ndjson_value(line, len(values)))
        if not len(values) & 255:
            await pause()
    return values


async def prepare_sliced(
    body: bytes, ndjson: bool, partitions: int, max_record_bytes: int
) -> Batch:
    """``prepare``, letting the event loop run every ``SLICE_S``."""
    pause = _Yielder()
    if ndjson:
        values = await _parse_ndjson_sliced(body, pause)
    else:
        values = await _parse_array_sliced(body, pause)
    batch = _new_batch()
    for start in range(0, len(values), 16):
        end = start + 16
        _add_all(batch, values[start:end], start, partitions, max_record_bytes)
        # Freed as we go: 200,000 parsed envelopes freed at once held the loop ~0.3 s.
        values[start:end] = [None] * len(values[start:end])
        await pause()
    return batch


async def release(*lists: list[Any]) -> None:
    """Empty big lists a slice at a time (freeing 200,000 records at once stalls the loop)."""
    pause = _Yielder()
    for items in lists:
        while items:
            del items[-4096:]
            await pause()


async def records_sliced(batch: Batch) -> list[Record]:
    """``records``, letting the event loop run every ``SLICE_S``."""
    pause = _Yielder()
    result: list[Record] = []
    size = len(batch.values)
    for start in range(0, size, 4096):
        end = min(start + 4096, size)
        result.extend(
            _records(
                batch.partitions[start:end], batch.episodes[start:end], batch.values[start:end]
            )
        )
        await pause()
    return result


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
            if len(body) >= SLICED_BYTES:
                return await prepare_sliced(body, ndjson, partitions, max_record_bytes)
            return prepare(body, ndjson, partitions, max_record_bytes)
        self._turn += 1
        worker = min(pool, key=lambda w: (len(w.pending), (w.next_id + self._turn) % 7))
        try:
            result = await worker.submit((body, ndjson, partitions, max_record_bytes))
        except _WorkerDied as e:
            logger.error("a validation worker died (%s); validating in the service process", e)
            return await prepare_sliced(body, ndjson, partitions, max_record_bytes)
        if isinstance(result, Batch):
            return result
        raise _refusal(*result)


def records(batch: Batch) -> list[Record]:
    """The batch's log records (keyed by episode, as ``Log.append`` keys them)."""
    return _records(batch.partitions, batch.episodes, batch.values)


def _records(partitions: list[int], episodes: list[str], values: list[bytes]) -> list[Record]:
    # map, not a comprehension: no Python frame per record
    return list(map(Record, partitions, map(str.encode, episodes), values))
