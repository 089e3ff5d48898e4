"""Transports: how a participant's events reach the log.

Both transports share one pipeline. Events are submitted with a reserved slot of a bounded
in-flight budget (``max_in_flight``: a full budget makes ``await`` wait instead of buffering without
bound), queued in submission order, and sent by one sender task that coalesces whatever is queued
into one request (``max_batch`` events). One request at a time keeps each participant's events in
``seq`` order in the log, which is what lets the fold drop a retried event as a duplicate: a failed
request is sent again unchanged, with the same ``seq``s. Fencing and validation errors are not
retried: they fail the events they name (and every event of the same fenced attempt or epoch) at
once, and the rest of the batch goes on.

Riding through outages: a retriable failure (the service restarting or unreachable, a broker
unavailable, ``503 unavailable``) is retried with jittered exponential backoff until the oldest
event of the request is ``deadline_s`` old (``DEFAULT_DEADLINE_S``, 120 s: long enough for a
service restart or upgrade). Meanwhile later events wait behind it, so order is kept. An event
whose append finally fails gets the error on its future (``emit``/``append`` raise it) and is
passed to ``on_failure(run, event, error)`` if given (for events nobody awaits).

The per-event work on the participant's loop is kept to what the contract needs (measured by
``benchmarks/sdk_overhead.py``): the participant classes build envelopes in the codec's field
order and mark them ``built``, so the Kafka path checks only their caller-supplied values
(``_encoding``) rather than running pydantic; a transport that opens its own HTTP connection posts
through ``_http1`` rather than httpx's pool; the sender slices the queue once per request.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import httpx
import orjson

from rolloutlog._plain_http import async_service_client
from rolloutlog._telemetry import client_span
from rolloutlog.errors import (
    AttemptFenced,
    BackendUnavailable,
    InvalidEvent,
    ParticipantFenced,
    PayloadTooLarge,
    RolloutlogError,
    error_from_wire,
)
from rolloutlog.log import (
    Log,
    Position,
    Record,
    check_record_size,
    encode_record,
    open_log,
    partition_for,
    validate_event,
)
from rolloutlog.participants._encoding import check_built, encode_record_fast, encode_wire
from rolloutlog.participants._http1 import Http1Connection
from rolloutlog.wire import NDJSON, direct_http_url, service_urls

__all__ = ["DEFAULT_DEADLINE_S", "FailureCallback", "HttpTransport", "KafkaTransport", "Transport"]

_log = logging.getLogger("rolloutlog.participants.transport")

#: How long an event's append is retried through retriable failures, from its submit.
DEFAULT_DEADLINE_S = 120.0

#: Called once for each event whose append finally failed: ``(run, event, error)``.
FailureCallback = Callable[[str, dict[str, Any], BaseException], None]


@dataclass(slots=True)
class _Pending:
    run: str
    event: dict[str, Any]
    body: bytes
    future: asyncio.Future[Position]
    submitted: float


@dataclass
class _Stats:
    requests: int = 0
    events: int = 0
    retries: int = 0
    failed: int = 0
    max_queued: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Transport(abc.ABC):
    """Registration and durable appends for participants; ``async with`` or ``start()``/``stop()``.

    ``append`` returns once every event is durable (the write-ahead rule), with each event's
    partition and offset. Events are plain envelope dicts (docs/design.md §3); the participant classes
    build them. ``deadline_s`` bounds how long an event's append rides through retriable
    failures (jittered exponential backoff from ``backoff_s`` up to ``max_backoff_s``);
    ``on_failure(run, event, error)`` hears of every event whose append finally failed.
    """

    def __init__(
        self,
        *,
        max_in_flight: int = 4096,
        max_batch: int = 512,
        max_batch_bytes: int = 8 * 1024 * 1024,
        deadline_s: float = DEFAULT_DEADLINE_S,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        on_failure: FailureCallback | None = None,
    ) -> None:
        if max_in_flight < 1 or max_batch < 1:
            raise ValueError("max_in_flight and max_batch must be at least 1")
        if deadline_s < 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need deadline_s >= 0 and 0 < backoff_s <= max_backoff_s")
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        #: A request stops growing past this many bytes (the service refuses bodies over its
        #: limit, 32 MiB by default, as a whole); one larger event still goes alone.
        self.max_batch_bytes = max_batch_bytes
        #: Retriable failures are retried until an event is this old (seconds from its submit).
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_failure = on_failure
        self.stats = _Stats()
        self._started = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._queue: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._sender: asyncio.Task[None] | None = None
        self._in_flight = 0
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open connections and start the sender."""
        if self._sender is not None:
            return
        self._closing = False
        self._started = True
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        await self._open()
        self._sender = asyncio.create_task(self._send_loop(), name="rolloutlog-sender")

    async def stop(self) -> None:
        """Send what is queued, then close."""
        sender, self._sender = self._sender, None
        if sender is not None:
            assert self._wakeup is not None
            self._closing = True
            self._wakeup.set()
            await sender
            for item in self._queue:
                if not item.future.done():
                    item.future.set_exception(BackendUnavailable("the transport was stopped"))
            self._queue.clear()
            self._started = False
        await self._close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- the interface -----------------------------------------------------------------------

    @abc.abstractmethod
    async def register(self, run: str, participant_id: str, kind: str) -> int:
        """Register a participant; returns its new epoch (higher than any before)."""

    async def append(self, run: str, events: Sequence[dict[str, Any]]) -> list[Position]:
        """Append events in order; returns once all are durable."""
        futures = []
        for event in events:
            await self.reserve()
            futures.append(self.submit(run, event))
        return list(await asyncio.gather(*futures))

    async def reserve(self) -> None:
        """Wait for a slot of the in-flight budget (the back-pressure point)."""
        if not self._started:
            raise RuntimeError("the transport is not started: use `async with` or start()")
        if self._in_flight < self.max_in_flight and not self._waiters:
            self._in_flight += 1
            return
        # First come, first served: ``_release`` hands freed slots to waiters in order.
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(1)  # granted as it was cancelled: give the slot back
            raise

    def try_reserve(self) -> bool:
        """Take a slot of the budget if one is free now (``reserve()`` without the wait)."""
        if self._in_flight < self.max_in_flight and not self._waiters and self._started:
            self._in_flight += 1
            return True
        return False

    def submit(
        self, run: str, event: dict[str, Any], *, built: bool = False
    ) -> asyncio.Future[Position]:
        """Queue one event under a slot ``reserve()`` took; the future resolves once durable.

        An event is sent even if its caller stops waiting (cancellation): its ``seq`` is taken.
        ``built`` marks an envelope a participant class built (the Kafka transport then checks
        only its caller-supplied values, see ``_encoding``).

        Synchronous on purpose: a caller that numbers events (``seq``) and submits them with no
        ``await`` in between gets them into the log in that order.
        """
        try:
            body = self._encode_built(run, event) if built else self._encode(run, event)
        except BaseException:
            self._release(1)
            raise
        loop = self._loop
        assert loop is not None
        future: asyncio.Future[Position] = loop.create_future()
        queue = self._queue
        queue.append(_Pending(run, event, body, future, loop.time()))
        if len(queue) == 1:
            self._wake()  # else the sender is awake already: it sleeps only on an empty queue
        return future

    @property
    def in_flight(self) -> int:
        """Events submitted (or reserved) and not yet acknowledged."""
        return self._in_flight

    # -- backend hooks -----------------------------------------------------------------------

    async def _open(self) -> None:  # noqa: B027 - optional hook
        """Open connections."""

    async def _close(self) -> None:  # noqa: B027 - optional hook
        """Close connections."""

    @abc.abstractmethod
    def _encode(self, run: str, event: dict[str, Any]) -> bytes:
        """Encode (and check) one event on the caller's loop turn."""

    def _encode_built(self, run: str, event: dict[str, Any]) -> bytes:
        """Encode (and check) one envelope a participant class built."""
        return self._encode(run, event)

    @abc.abstractmethod
    async def _send(self, run: str, items: Sequence[_Pending]) -> list[Position]:
        """Append one batch, all or nothing; raise rolloutlog errors."""

    # -- the sender --------------------------------------------------------------------------

    def _wake(self) -> None:
        assert self._wakeup is not None
        self._wakeup.set()

    def _release(self, count: int) -> None:
        self._in_flight -= count
        waiters = self._waiters
        while waiters and self._in_flight < self.max_in_flight:
            waiter = waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)

    async def _send_loop(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            queue = self._queue
            # Only submits add and only this removes: the queue is longest right now.
            self.stats.max_queued = max(self.stats.max_queued, len(queue))
            run = queue[0].run
            count = size = 0
            max_batch, max_bytes = self.max_batch, self.max_batch_bytes
            for item in queue:
                size += len(item.body)
                if count and (item.run != run or count >= max_batch or size > max_bytes):
                    break
                count += 1
            batch = queue[:count]
            del queue[:count]
            try:
                await self._deliver(run, batch)
            finally:
                self._release(len(batch))

    async def _deliver(self, run: str, batch: list[_Pending]) -> None:
        failures = 0
        while batch:
            try:
                self.stats.requests += 1
                positions = await self._send(run, batch)
            except (AttemptFenced, ParticipantFenced, InvalidEvent, PayloadTooLarge) as e:
                batch = self._fail_named(batch, e)
                continue
            except RolloutlogError as e:
                failures += 1
                delay = self._retry_delay(batch, failures) if e.retriable else None
                if delay is None:
                    self._fail(batch, e)
                    return
                self.stats.retries += 1
                await asyncio.sleep(delay)
                continue
            except Exception as e:  # an unexpected failure fails the batch, never the sender
                self._fail(batch, BackendUnavailable(f"append failed: {e!r}"))
                return
            self.stats.events += len(batch)
            for item, position in zip(batch, positions, strict=True):
                if not item.future.done():
                    item.future.set_result(position)
            return

    def _retry_delay(self, batch: Sequence[_Pending], failures: int) -> float | None:
        """The pause before retry ``failures`` of ``batch``: doubling from ``backoff_s`` up to
        ``max_backoff_s``, times a random factor in [0.5, 1] (participants that lost the service
        together do not come back in step), cut to what is left of the oldest event's deadline;
        None once that deadline has passed."""
        assert self._loop is not None
        left = batch[0].submitted + self.deadline_s - self._loop.time()
        if left <= 0:
            return None
        delay = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(failures - 1, 16))
        return min(left, delay * random.uniform(0.5, 1.0))

    def _fail(self, batch: Sequence[_Pending], error: BaseException) -> None:
        self.stats.failed += len(batch)
        if batch:
            first = batch[0].event
            _log.warning(
                "%d event(s) of run %s failed for good (first: %s seq %s of episode %s): %r",
                len(batch),
                batch[0].run,
                first.get("type"),
                first.get("seq"),
                first.get("episode"),
                error,
            )
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)
            if self.on_failure is not None:
                try:
                    self.on_failure(item.run, item.event, error)
                except Exception:  # a broken callback must not stop the sender
                    _log.exception("on_failure raised")

    def _fail_named(self, batch: list[_Pending], error: RolloutlogError) -> list[_Pending]:
        """Fail the events an all-or-nothing refusal names; return the rest to send again."""
        index = error.details.get("index")
        if not isinstance(index, int) or not 0 <= index < len(batch):
            self._fail(batch, error)
            return []
        named = batch[index].event
        if isinstance(error, ParticipantFenced):
            who = named["participant"]

            def same(event: dict[str, Any]) -> bool:
                return bool(event["participant"] == who)
        elif isinstance(error, AttemptFenced):
            key = (named["episode"], named["attempt"])

            def same(event: dict[str, Any]) -> bool:
                return (event["episode"], event["attempt"]) == key
        else:

            def same(event: dict[str, Any]) -> bool:
                return event is named

        failed = [item for item in batch if same(item.event)]
        self._fail(failed, error)
        return [item for item in batch if not same(item.event)]


class _Rest:
    """The few REST calls participants make (registration, projections)."""

    def __init__(self, url: str | None, token: str | None, client: httpx.AsyncClient | None):
        # One URL (a balancer, or the first of a ``ROLLOUTLOG_URL`` list the trainer shares).
        self.url = service_urls(url)[0]
        self.owns_client = client is None
        self.client = client or async_service_client(self.url, 60.0)
        self.prefix = "" if client is None or url is None else self.url
        token = token if token is not None else os.environ.get("ROLLOUTLOG_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        try:
            with client_span(method, path, headers) as traced:
                response = await self.client.request(
                    method, self.prefix + path, headers=traced, **kw
                )
        except httpx.TransportError as e:
            raise BackendUnavailable(f"the service did not answer: {e!r}") from e
        if response.is_error:
            raise error_from_wire(response.status_code, response.content)
        return response

    async def register(self, run: str, participant_id: str, kind: str) -> int:
        response = await self.request(
            "POST", f"/v1/runs/{run}/participants", json={"id": participant_id, "kind": kind}
        )
        epoch: int = orjson.loads(response.content)["epoch"]
        return epoch

    async def close(self) -> None:
        if self.owns_client:
            await self.client.aclose()


class HttpTransport(Transport):
    """Events over HTTP through the service: batched NDJSON ``POST /v1/runs/{run}/events``.

    ``client`` is an ``httpx.AsyncClient`` (e.g. over ``httpx.ASGITransport`` in tests); without
    one the transport opens its own to ``url`` (default ``ROLLOUTLOG_URL``) and posts events over
    one lean keep-alive HTTP/1.1 connection (``_http1``; httpx when a proxy is configured for
    ``url``). ``token`` defaults to ``ROLLOUTLOG_TOKEN``. The service validates every envelope,
    so the client only encodes.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        max_event_bytes: int = 32 * 1024 * 1024,
        deadline_s: float = DEFAULT_DEADLINE_S,
        on_failure: FailureCallback | None = None,
        **options: Any,
    ) -> None:
        super().__init__(deadline_s=deadline_s, on_failure=on_failure, **options)
        #: The service's body limit (``serve --max-body-mb``, 32 MiB by default): a larger event
        #: is refused on submit, since the service would close the connection on it unread.
        self.max_event_bytes = max_event_bytes
        self._rest = _Rest(url, token, client)
        self._events: Http1Connection | None = None
        if client is None and direct_http_url(self._rest.url):
            self._events = Http1Connection(self._rest.url, self._rest.headers)

    async def register(self, run: str, participant_id: str, kind: str) -> int:
        return await self._rest.register(run, participant_id, kind)

    async def _close(self) -> None:
        if self._events is not None:
            self._events.close()
        await self._rest.close()

    def _encode(self, run: str, event: dict[str, Any]) -> bytes:
        body = encode_wire(event)
        check_record_size(len(body), self.max_event_bytes, limit_of="the service")
        return body

    async def _send(self, run: str, items: Sequence[_Pending]) -> list[Position]:
        body = b"\n".join([item.body for item in items])
        path = f"/v1/runs/{run}/events"
        if self._events is None:
            response = await self._rest.request(
                "POST", path, content=body, headers={"Content-Type": NDJSON}
            )
            content = response.content
        else:
            status, content = await self._events.post(path, body, NDJSON)
            if status >= 300:
                raise error_from_wire(status, content)
        offsets = orjson.loads(content)["offsets"]
        return [Position(o["partition"], o["offset"]) for o in offsets]


class KafkaTransport(Transport):
    """Events straight into the run's Kafka topic through ``rolloutlog.log``'s Kafka backend.

    ``log`` is a ``kafka://host:port`` URL (opened and closed here) or a ``Log`` already open.
    Each event is checked on submit, since no service checks it on this path: the envelopes the
    participant classes build by their caller-supplied values (``_encoding.check_built``), any
    other by pydantic (``validate=False`` skips both). Each is encoded as a log record and
    appended with ``Log.append_records`` (murmur2 partitions, ``acks=all``; it returns once
    acknowledged). Registration goes through the service's REST route
    (``POST /v1/runs/{run}/participants``), so the epochs the service fences with are the ones
    participants write with: pass ``url``/``token`` or an ``httpx.AsyncClient`` for it.
    """

    def __init__(
        self,
        log: str | Log,
        *,
        url: str | None = None,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        validate: bool = True,
        deadline_s: float = DEFAULT_DEADLINE_S,
        on_failure: FailureCallback | None = None,
        **options: Any,
    ) -> None:
        super().__init__(deadline_s=deadline_s, on_failure=on_failure, **options)
        self.validate = validate
        self._owns_log = isinstance(log, str)
        self.log: Log = open_log(log) if isinstance(log, str) else log
        self._rest = _Rest(url, token, client)
        self._partitions: dict[str, int] = {}

    async def _open(self) -> None:
        if self._owns_log:
            await self.log.start()

    async def _close(self) -> None:
        await self._rest.close()
        if self._owns_log:
            await self.log.close()

    async def register(self, run: str, participant_id: str, kind: str) -> int:
        epoch = await self._rest.register(run, participant_id, kind)
        if run not in self._partitions:
            self._partitions[run] = await self.log.partitions(run)
        return epoch

    def _encode(self, run: str, event: dict[str, Any]) -> bytes:
        if self.validate:
            return self._bounded(encode_record(validate_event(event)))
        return self._bounded(encode_record_fast(event))

    def _encode_built(self, run: str, event: dict[str, Any]) -> bytes:
        if self.validate:
            return self._bounded(check_built(event))
        return self._bounded(encode_record_fast(event))

    def _bounded(self, record: bytes) -> bytes:
        check_record_size(len(record), self.log.max_record_bytes)
        return record

    async def _send(self, run: str, items: Sequence[_Pending]) -> list[Position]:
        partitions = self._partitions.get(run)
        if partitions is None:
            partitions = self._partitions[run] = await self.log.partitions(run)
        records = [
            Record(
                partition_for(item.event["episode"], partitions),
                item.event["episode"].encode(),
                item.body,
            )
            for item in items
        ]
        return await self.log.append_records(run, records)
