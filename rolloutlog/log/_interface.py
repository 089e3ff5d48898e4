"""The ``Log`` interface every backend implements, and ``open_log`` that picks one by URL."""

from __future__ import annotations

import abc
import asyncio
import importlib
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self

from rolloutlog.core import Event, partition_for, run_name_problem
from rolloutlog.errors import ConfigurationError, InvalidRequest, PayloadTooLarge
from rolloutlog.log._codec import decode_record, validate_events
from rolloutlog.log._record import encode_record, marker_record

#: Largest record (metadata plus payload) a backend accepts by default: 16 MiB.
DEFAULT_MAX_RECORD_BYTES = 16 * 1024 * 1024
DEFAULT_PARTITIONS = 16
#: Most partitions a run may have (both backends; a partition costs the projector and every
#: checkpoint one marker and one manifest part, and Kafka brokers a file or more each).
MAX_PARTITIONS = 256


class Position(NamedTuple):
    """Where an appended record landed."""

    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Record:
    """An encoded event bound for one partition."""

    partition: int
    key: bytes | None
    value: bytes


class Log(abc.ABC):
    """An append-only, partitioned event log: one topic per run.

    Every write returns only once it is durable. Reads are bounded by offsets the caller
    knows (from appends and markers), never by asking the backend where the end is.
    """

    url: str
    max_record_bytes: int
    #: Whether a reader folding partition after partition should open the next one's read before
    #: it needs it: a read's first page is a round trip to a broker (Kafka), not a local page,
    #: which is no wait, and an early read would hold a second file connection per run.
    read_ahead: bool = False

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect / open files."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release every resource; pending appends finish first."""

    @abc.abstractmethod
    async def ensure_run(self, run: str, partitions: int = DEFAULT_PARTITIONS) -> int:
        """Create the run's topic if missing; return its partition count (which wins if it exists)."""

    @abc.abstractmethod
    async def partitions(self, run: str) -> int:
        """The run's partition count; ``UnknownRun`` when it has no topic."""

    @abc.abstractmethod
    async def append_records(self, run: str, records: Sequence[Record]) -> list[Position]:
        """Append encoded records, all or none; positions in input order, once durable."""

    async def read_records(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Records of ``partition`` with ``start <= offset < end``, in order, as raw bytes
        (``read_pages``, a record at a time)."""
        async for page in self.read_pages(run, partition, start, end):
            for item in page:
                yield item

    @abc.abstractmethod
    def read_pages(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """``read_records`` a page (list) at a time, as the backend reads them: bulk replays and a
        projector catching up take no coroutine step per record."""

    async def read_pages_in_place(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[Sequence[tuple[int, bytes | memoryview]]]:
        """``read_pages`` whose large records may be read-only views of the log's own storage
        (the embedded log's blob files, mapped): for a replay whose output carries them as they
        are (a restore's lines), so that they are not copied into fresh memory first. A view
        keeps what it shows readable for as long as it lives. Backends without such storage
        give ``read_pages``' records."""
        async for page in self.read_pages(run, partition, start, end):
            yield page

    @abc.abstractmethod
    async def delete_run(self, run: str) -> bool:
        """Delete the run's topic and everything in it (its followers end); False when it had
        none. A later ``ensure_run`` starts the name afresh."""

    @abc.abstractmethod
    async def trim(self, run: str, partition: int, before: int) -> bool:
        """Drop records below ``before`` where the backend can; False when it cannot."""

    @abc.abstractmethod
    async def end_offsets(self, run: str) -> list[int]:
        """The next offset of every partition, as far as this log instance knows it."""

    async def latest_offsets(self, run: str) -> list[int]:
        """The next offset of every partition including other writers' records (participants
        appending to the log directly): what a reader must fold to have seen every record
        appended before the call. Backends where ``end_offsets`` may miss those override it."""
        return await self.end_offsets(run)

    async def follow(
        self, run: str, partition: int, start: int, *, poll_s: float = 0.05
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Pages of ``partition``'s records from ``start`` on, waiting for new ones as they are
        appended; it never ends by itself (cancel the consuming task to stop).

        This default polls ``end_offsets``; backends override it with something better.
        """
        next_offset = start
        while True:
            end = (await self.end_offsets(run))[partition]
            page = [item async for item in self.read_records(run, partition, next_offset, end)]
            if page:
                next_offset = page[-1][0] + 1
                yield page
            else:
                await asyncio.sleep(poll_s)

    async def follow_run(
        self,
        run: str,
        starts: Sequence[int],
        *,
        partitions: Collection[int] | None = None,
        poll_s: float = 0.05,
    ) -> AsyncIterator[tuple[int, list[tuple[int, bytes]]]]:
        """``(partition, page)`` for every partition ``p`` from ``starts[p]`` on (only those of
        ``partitions`` when given: a replica follows the partitions it owns), each partition's
        pages in order; it never ends by itself (cancel the consuming task to stop).

        One follower per run, so that what a follower holds (connections, threads) does not grow
        with runs x partitions. This default merges per-partition ``follow`` iterators (one
        task each); backends override it with a single reader.
        """
        queue: asyncio.Queue[tuple[int, list[tuple[int, bytes]]] | BaseException] = asyncio.Queue(
            maxsize=len(starts) or 1
        )

        async def pump(partition: int, start: int) -> None:
            try:
                async for page in self.follow(run, partition, start, poll_s=poll_s):
                    await queue.put((partition, page))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer, which raises it
                await queue.put(e)

        tasks = [
            asyncio.create_task(pump(partition, start))
            for partition, start in enumerate(starts)
            if partitions is None or partition in partitions
        ]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def ping(self) -> None:  # noqa: B027 - optional hook: most backends need no probe
        """Raise ``BackendUnavailable`` when the backend cannot be reached."""

    # -- shared behaviour, built on the primitives above ---------------------------------------

    async def append(self, run: str, events: Sequence[Event | dict[str, Any]]) -> list[Position]:
        """Validate, encode and append a batch of events, all or none; once durable, return each
        event's partition and offset in input order."""
        checked = validate_events(events)
        partitions = await self.partitions(run)
        records = [self._record(event, partitions, index) for index, event in enumerate(checked)]
        return await self.append_records(run, records)

    def check_records(self, records: Sequence[Record]) -> None:
        """``PayloadTooLarge`` for the first record past ``max_record_bytes``. Every backend's
        ``append_records`` calls it before writing anything (so ``append`` is checked too)."""
        limit = self.max_record_bytes
        if not records or max(len(record.value) for record in records) <= limit:
            return
        for index, record in enumerate(records):
            check_record_size(len(record.value), limit, index=index)

    def _record(self, event: Event, partitions: int, index: int) -> Record:
        value = encode_record(event)
        if event.episode is None:
            raise InvalidRequest(f"event {index}: {event.type} events are written by the service")
        return Record(partition_for(event.episode, partitions), event.episode.encode(), value)

    async def write_markers(self, run: str, checkpoint_id: int, controller_epoch: int) -> list[int]:
        """Write a ``checkpoint.marker`` into every partition; return the marker offsets."""
        partitions = await self.partitions(run)
        value = marker_record(checkpoint_id, controller_epoch, time.time())
        records = [Record(partition, None, value) for partition in range(partitions)]
        positions = await self.append_records(run, records)
        return [position.offset for position in positions]

    async def read(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[tuple[int, Event]]:
        """Typed events of ``partition`` with ``start <= offset < end``, in order."""
        async for offset, value in self.read_records(run, partition, start, end):
            yield offset, decode_record(value)


def check_record_size(
    size: int, max_bytes: int, *, index: int | None = None, limit_of: str = "the log"
) -> None:
    """``PayloadTooLarge`` for an encoded event (a record) of ``size`` bytes past ``max_bytes``:
    the one size rule, applied by the backends (``Log.check_records``), by the service to a batch
    before appending it, and by the SDK before sending."""
    if size <= max_bytes:
        return
    what = "event" if index is None else f"event {index}"
    details: dict[str, int] = {"size": size, "max_bytes": max_bytes}
    if index is not None:
        details["index"] = index
    raise PayloadTooLarge(
        f"{what} is {size} bytes; {limit_of} accepts at most {max_bytes}", **details
    )


def check_partitions(partitions: int) -> None:
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise InvalidRequest(
            f"partitions must be 1..{MAX_PARTITIONS}, not {partitions}", field="partitions"
        )


def check_run_name(run: str) -> None:
    """``InvalidRequest`` for a run name the log cannot take (a run names a Kafka topic): the
    catalog checks it too, so that a run it takes has a log."""
    problem = run_name_problem(run) if isinstance(run, str) else "must be a string"
    if problem is not None:
        raise ConfigurationError(f"invalid run name {run!r}: {problem}", field="run")


_BACKENDS = {"embedded": "rolloutlog.log.embedded", "kafka": "rolloutlog.log.kafka"}


def open_log(url: str | Path, **options: Any) -> Log:
    """The log backend a URL names: ``embedded:///path``, a plain data directory, or
    ``kafka://host:port[,host:port]``. The backend module is imported only when used."""
    text = str(url)
    scheme, sep, _ = text.partition("://")
    if not sep:
        scheme, text = "embedded", f"embedded://{Path(text).resolve()}"
    module_name = _BACKENDS.get(scheme)
    if module_name is None:
        raise ConfigurationError(
            f"unknown log URL scheme {scheme!r}: use embedded:///path or kafka://host:port"
        )
    module = importlib.import_module(module_name)
    backend: Log = module.from_url(text, **options)
    return backend
