"""Reads of the Kafka log backend: ranges, follows of one partition or of a whole run, and the
detection of a lost run.

Every read keeps a cursor per partition and decides what a Fetch answer means for it
(``_Cursor.take``): records to hand over, a range stepped over, the end of what exists, a batch
the broker cut at the page size (grow the page for it, once), or an empty answer below the
high-water mark. Tansu gives the last one under concurrent appends: it raises the high-water
mark before the batch below it can be fetched, for a few milliseconds. Such an answer is not a
large batch (Tansu returns a batch larger than the page whole, and Apache Kafka cuts it), so the
read backs off and asks again, and only an answer that stays empty past the request timeout is
an error (``BackendUnavailable``, retriable). Growing the page for it instead, and keeping the
grown page, is what used to kill followers under load: every transient empty answer doubled the
page until it passed its limit ("no complete record batch in 67371008 bytes").

For the same few milliseconds Tansu can answer with a batch but without the one below it (from
1172: the batches at 1172 and 1180, not 1176). A run's topic is never compacted, so its offsets
follow each other without gaps: ``parse_records`` stops at such a hole, the cursor hands over
what came before it and asks again from the hole, as after an empty answer. Stepping over it,
as over a compaction gap, lost the left-out records to the follower.

Tansu also answers with nothing below the high-water mark when a Fetch's ``max_wait`` ran out
before it found the batches: it lists a partition's batches for as long as the wait lasts. A
cursor known to be behind the high-water mark therefore asks with a long wait
(``BEHIND_WAIT_MS``, doubled after each such empty answer up to a third of the request
timeout), and one at the end with the short one, so that a follower at the end is not held.
Apache Kafka answers a Fetch below the high-water mark at once, whatever its wait. With the
short wait everywhere, a projector starting far into a long partition on a busy machine got
nothing, at every retry, for good.

A run is lost (``RunLost``) when its topic vanished or lost partitions, or a partition's high-water
mark stays below an offset known to exist there (this instance's acknowledged end, or where a read
is): a broker that restarted empty, with the topic recreated behind it. Apache Kafka's high-water
mark can lag for a moment after a leader moves, so a short one is trusted only after it has
stayed short for ``_LOSS_CONFIRM_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiokafka.errors as kafka_errors

from rolloutlog._malloc import SERVICE_MMAP_THRESHOLD
from rolloutlog.errors import BackendUnavailable, InvalidRequest, LogError, RunLost
from rolloutlog.log._kafka_wire import (
    BEHIND_WAIT_MS,
    EARLIEST,
    FETCH_WAIT_MS,
    REQUEST_ERRORS,
    Answer,
    ClientPool,
    fetch,
    list_offsets,
    parse_records,
    translate,
)

__all__ = ["KafkaReads", "ReadTopic", "check_partition"]

#: First wait after an answer that must be asked again; doubled up to the poll interval.
_RETRY_S = 0.01
#: How long a high-water mark below a known offset must last before the run counts as lost
#: (Tansu resuming from an 8 s stall reported a stale high-water mark for over 3 s).
_LOSS_CONFIRM_S = 10.0
_FOREVER = 1 << 62
#: A follower at the end that nothing woke asks with the long wait every this many polls.
_IDLE_RECHECK_ROUNDS = 10
#: Records at least this large on average (S2's 350 KB session states) are read
#: ``_LARGE_RECORDS_PAGE`` at a time.
_LARGE_RECORD_BYTES = 64 * 1024
#: The page of large records: a Fetch answer holds it and at most one batch past it, so that
#: it stays below the service's mmap threshold. An answer of that size or more gets pages of
#: its own three times over (the connection's buffer, the response frame, its record set),
#: each fresh and faulted in, where smaller ones reuse the heap's. Measured on S2 on Kafka
#: (``restore_fetch.py``, 4 MB pages against 512 KB): the service's CPU per restore + fetch
#: 1.23-1.59 s against 1.03-1.22 s; on S1 (small records) the page does not change.
_LARGE_RECORDS_PAGE = SERVICE_MMAP_THRESHOLD // 2
#: Between a follower's attempts to reach a broker it lost.
_RECONNECT_S = 0.25
#: How long a read that failed to reach a leader looks for new leaders before it gives up.
_REFRESH_S = 1.0


@dataclass(eq=False)
class ReadTopic:
    """What reads need to know of a run's topic (``_kafka_writes.Topic`` is one)."""

    name: str
    partitions: int
    leaders: list[int]
    #: Next offset per partition as acknowledged to this instance; -1 before its first ack.
    acked_ends: list[int]


# What a cursor makes of one answer.
_PROGRESS, _AT_END, _AGAIN, _WAIT = range(4)


@dataclass(eq=False, slots=True)
class _Cursor:
    """One partition's read position and what its last answers said."""

    partition: int
    offset: int
    end: int
    page_bytes: int
    #: How long the broker may spend on the next Fetch (``_kafka_wire.BEHIND_WAIT_MS``).
    wait_ms: int = FETCH_WAIT_MS
    #: When the current offset first got an empty answer below the high-water mark.
    empty_since: float | None = None
    #: When a high-water mark below a known offset was first seen.
    short_since: float | None = None
    records: list[tuple[int, bytes]] = field(default_factory=list)
    highwater: int = 0


class KafkaReads:
    """The read side of ``KafkaLog`` (a mixin: the log supplies the attributes below)."""

    _readers: ClientPool
    #: Followers to wake by (topic, partition); partition -1 wakes a whole run's follower.
    _wakers: dict[tuple[str, int], set[asyncio.Event]]
    _fetch_bytes: int
    _max_message_bytes: int
    _request_timeout_ms: int

    async def _read_topic(self, run: str) -> ReadTopic:
        raise NotImplementedError

    async def _describe(self, name: str) -> tuple[int, list[int]] | None:
        raise NotImplementedError

    # -- public reads ------------------------------------------------------------------------------

    async def read_pages(
        self, run: str, partition: int, start: int, end: int
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Records of ``start <= offset < end`` as the Fetch answers hold them, a page (list)
        per answer, fetching the next page while the caller consumes the current one (no
        coroutine step per record: a projector catching up reads every record of a partition
        through here). A range reaching past the end yields what exists; one starting past the
        end of a partition is a lost run (``RunLost``): reads start at offsets known to exist."""
        topic = await self._read_topic(run)
        check_partition(topic, partition)
        start = max(start, 0)
        if end <= start:
            return
        # A range starts at an offset known to exist: ask as from behind the high-water mark.
        cursor = _Cursor(partition, start, end, self._fetch_bytes, BEHIND_WAIT_MS)
        client = await self._readers.acquire()
        following: asyncio.Task[int] | None = None
        broken = False
        try:
            while True:
                if following is None:
                    state = await self._step(client, topic, cursor)
                else:
                    state, following = await following, None
                if state == _AT_END:
                    return
                if state != _PROGRESS:
                    continue
                records = cursor.records
                if cursor.offset < min(end, cursor.highwater):
                    following = asyncio.create_task(self._step(client, topic, cursor))
                if records:
                    yield records
                if following is None and cursor.offset >= end:
                    return
        except Exception:
            broken = True
            raise
        finally:
            if following is not None:
                following.cancel()
                with contextlib.suppress(BaseException):
                    await following
            await self._readers.release(client, broken=broken)

    async def follow(
        self, run: str, partition: int, start: int, *, poll_s: float = 0.1
    ) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Pages from ``start`` on, from its own reader connection. Records this instance
        appends wake it at once; other writers' records are found by polling every ``poll_s``."""
        topic = await self._read_topic(run)
        check_partition(topic, partition)
        cursor = _Cursor(partition, max(start, 0), _FOREVER, 0)
        async for _, page in self._follow(topic, [cursor], poll_s, partition):
            yield page

    async def follow_run(
        self,
        run: str,
        starts: Sequence[int],
        *,
        partitions: Collection[int] | None = None,
        poll_s: float = 0.05,
    ) -> AsyncIterator[tuple[int, list[tuple[int, bytes]]]]:
        """Every partition ``p`` (of ``partitions`` when given) from ``starts[p]`` on, from one
        reader connection: each round is one Fetch per leader for all of them at their own
        offsets. This instance's acks wake it at once; other writers' records are found by
        polling every ``poll_s``."""
        topic = await self._read_topic(run)
        if len(starts) > topic.partitions:
            raise InvalidRequest(
                f"{len(starts)} start offsets for {topic.name}, which has {topic.partitions}",
                topic=topic.name,
            )
        cursors = [
            _Cursor(partition, max(start, 0), _FOREVER, 0)
            for partition, start in enumerate(starts)
            if partitions is None or partition in partitions
        ]
        async for item in self._follow(topic, cursors, poll_s, -1):
            yield item

    # -- the follow loop -----------------------------------------------------------------------------

    async def _follow(
        self, topic: ReadTopic, cursors: list[_Cursor], poll_s: float, woken_by: int
    ) -> AsyncIterator[tuple[int, list[tuple[int, bytes]]]]:
        """Pages of ``cursors``' partitions; ``woken_by`` is the partition whose acks wake it
        (-1: any of the run's)."""
        for cursor in cursors:
            cursor.page_bytes = self._fetch_bytes
        if not cursors:
            await asyncio.Event().wait()  # nothing to follow, ever
        waker = asyncio.Event()
        key = (topic.name, woken_by)
        self._wakers.setdefault(key, set()).add(waker)
        client: Any = None
        retry_s = _RETRY_S
        #: Since when every round failed to reach the broker.
        failing_since: float | None = None
        turn = 0
        #: Rounds in a row at the end without a wake-up (see ``_IDLE_RECHECK_ROUNDS``).
        idle = 0
        try:
            while True:
                waker.clear()
                # Rotate the order: a broker fills the first partitions of an answer first.
                order = cursors[turn:] + cursors[:turn]
                turn = (turn + 1) % len(cursors)
                try:
                    if client is None:
                        client = await self._readers.acquire()
                    states = await self._step_all(client, topic, order)
                except BackendUnavailable:
                    # A reset connection or a stalled broker: reconnect and go on from the
                    # cursors, up to the request timeout; past it, the caller's supervisor
                    # decides (the error is retriable).
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if client is not None:
                        await self._readers.release(client, broken=True)
                        client = None
                    if now - failing_since > self._request_timeout_ms / 1000:
                        raise
                    await asyncio.sleep(_RECONNECT_S)
                    continue
                failing_since = None
                progressed = False
                for cursor, state in zip(order, states, strict=True):
                    if state == _PROGRESS:
                        progressed = True
                        if cursor.records:
                            yield cursor.partition, cursor.records
                if progressed or _AGAIN in states:
                    retry_s = _RETRY_S
                    idle = 0
                    continue
                if _WAIT in states:
                    await asyncio.sleep(min(retry_s, poll_s))
                    retry_s *= 2
                    continue
                retry_s = _RETRY_S
                woken = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_s):
                        woken = await waker.wait()
                idle = 0 if woken else idle + 1
                if idle % _IDLE_RECHECK_ROUNDS == 0 and not woken:
                    # Every cursor looks at the end and nothing of ours woke us. Tansu answers a
                    # short wait with the high-water mark of the batches it listed in that time,
                    # which under load can stop short of the real end and look like it: now and
                    # then ask with the long wait, which lists them all.
                    for cursor in cursors:
                        cursor.wait_ms = max(cursor.wait_ms, BEHIND_WAIT_MS)
        finally:
            wakers = self._wakers.get(key)
            if wakers is not None:
                wakers.discard(waker)
                if not wakers:
                    del self._wakers[key]
            if client is not None:
                await self._readers.release(client)

    # -- one round ---------------------------------------------------------------------------------

    async def _step(self, client: Any, topic: ReadTopic, cursor: _Cursor) -> int:
        """One round for the one cursor of a bounded read; it backs off itself when it must
        ask again later."""
        (state,) = await self._step_all(client, topic, [cursor])
        if state == _WAIT:
            await asyncio.sleep(_RETRY_S * 5)
        return state

    async def _step_all(self, client: Any, topic: ReadTopic, cursors: list[_Cursor]) -> list[int]:
        """Fetch every cursor's next page in one request per leader; what each answer means."""
        where = f"read {topic.name}"
        offsets = {cursor.partition: cursor.offset for cursor in cursors}
        pages = {cursor.partition: cursor.page_bytes for cursor in cursors}
        # One wait per request: a broker answers as soon as it has records for any partition.
        wait_ms = max(cursor.wait_ms for cursor in cursors)
        try:
            async with asyncio.timeout(self._request_timeout_ms / 1000):
                answers = await fetch(client, topic.name, topic.leaders, offsets, pages, wait_ms)
        except REQUEST_ERRORS as e:
            # A leader that cannot be reached may be one that is gone (its partitions moved):
            # without a look at the metadata, every later read would ask it again.
            await self._refresh_leaders_quietly(topic)
            raise translate(e, where, topic=topic.name) from e
        states = []
        refresh = False
        for cursor in cursors:
            answer = answers.get(cursor.partition)
            state = await self._take(client, topic, cursor, answer)
            refresh = refresh or (
                state == _WAIT and (answer is None or answer.error is not kafka_errors.NoError)
            )
            states.append(state)
        if refresh:
            await self._refresh_leaders(topic)
        return states

    async def _take(
        self, client: Any, topic: ReadTopic, cursor: _Cursor, answer: Answer | None
    ) -> int:
        """What ``answer`` means for ``cursor``; moves it past what it delivered."""
        partition, offset = cursor.partition, cursor.offset
        where = f"read {topic.name}[{partition}] at offset {offset}"
        cursor.records = []
        now = time.monotonic()
        if answer is None:  # left out of the answer: ask again
            return self._still_empty(topic, cursor, now, "the broker left the partition out")
        error = answer.error
        if error is kafka_errors.OffsetOutOfRangeError:
            try:
                earliest = await list_offsets(
                    client, topic.name, topic.leaders, [partition], EARLIEST
                )
            except REQUEST_ERRORS as e:
                raise translate(e, where, topic=topic.name, partition=partition) from e
            if offset < earliest.get(partition, 0):
                cursor.offset = earliest[partition]  # trimmed: the range's rest starts there
                return _PROGRESS
            return self._short(topic, cursor, now, -1)
        if error is kafka_errors.UnknownTopicOrPartitionError:
            await self._check_exists(topic)
        if error is not kafka_errors.NoError:
            if not error.retriable:
                raise translate(error(), where, topic=topic.name, partition=partition)
            return self._still_empty(topic, cursor, now, error.__name__)
        known = max(
            offset, topic.acked_ends[partition] if partition < len(topic.acked_ends) else -1
        )
        if answer.highwater < known:
            return self._short(topic, cursor, now, answer.highwater)
        cursor.short_since = None
        cursor.highwater = answer.highwater
        parsed = parse_records(answer.data, offset, cursor.end)
        if parsed.records or parsed.following > offset:
            cursor.records = parsed.records
            cursor.offset = parsed.following
            cursor.empty_since = None
            # The next page: a small one after an answer of large records.
            size = len(answer.data or b"")
            large = bool(parsed.records) and size >= _LARGE_RECORD_BYTES * len(parsed.records)
            cursor.page_bytes = (
                min(self._fetch_bytes, _LARGE_RECORDS_PAGE) if large else self._fetch_bytes
            )
            behind = cursor.offset < answer.highwater
            cursor.wait_ms = max(cursor.wait_ms, BEHIND_WAIT_MS) if behind else FETCH_WAIT_MS
            return _PROGRESS
        if offset >= answer.highwater or offset >= cursor.end:
            cursor.empty_since = None
            cursor.wait_ms = FETCH_WAIT_MS
            return _AT_END
        # Records exist from here on, and the broker found none: give it longer (Tansu lists
        # the partition's batches only for as long as the wait lasts).
        cursor.wait_ms = min(max(2 * cursor.wait_ms, BEHIND_WAIT_MS), self._request_timeout_ms // 3)
        if parsed.truncated > cursor.page_bytes:
            # The broker cut the next batch at the page size: ask once more with room for it.
            limit = 4 * self._max_message_bytes
            if parsed.truncated > limit:
                raise LogError(
                    f"{where}: a record batch of {parsed.truncated} bytes, larger than the "
                    f"{limit} this log reads",
                    topic=topic.name,
                    partition=partition,
                    offset=offset,
                )
            cursor.page_bytes = parsed.truncated
            return _AGAIN
        if parsed.hole >= 0:
            why = f"the broker's answers leave out offsets {offset} to {parsed.hole - 1}"
        else:
            why = f"no records below the high-water mark {answer.highwater}"
        return self._still_empty(topic, cursor, now, why)

    def _still_empty(self, topic: ReadTopic, cursor: _Cursor, now: float, why: str) -> int:
        """An answer without records that should have had some: wait and ask again, up to the
        request timeout."""
        if cursor.empty_since is None:
            cursor.empty_since = now
        elif now - cursor.empty_since > self._request_timeout_ms / 1000:
            raise BackendUnavailable(
                f"read {topic.name}[{cursor.partition}] at offset {cursor.offset}: {why} for "
                f"{self._request_timeout_ms} ms",
                topic=topic.name,
                partition=cursor.partition,
                offset=cursor.offset,
            )
        return _WAIT

    def _short(self, topic: ReadTopic, cursor: _Cursor, now: float, highwater: int) -> int:
        """The partition ends below an offset known to exist there."""
        if cursor.short_since is None:
            cursor.short_since = now
        if now - cursor.short_since < _LOSS_CONFIRM_S:
            return _WAIT
        partition = cursor.partition
        known = max(cursor.offset, topic.acked_ends[partition])
        ends = f"ends at {highwater}" if highwater >= 0 else "ends"
        raise RunLost(
            f"{topic.name}[{partition}] {ends}, below offset {known}, which existed: the broker "
            "lost the run's records (restarted empty?)",
            topic=topic.name,
            partition=partition,
            offset=known,
        )

    async def _check_exists(self, topic: ReadTopic) -> tuple[int, list[int]]:
        """The topic's partitions and leaders; ``RunLost`` when a topic this instance knew is
        gone or has lost partitions."""
        described = await self._describe(topic.name)
        if described is None or 0 < described[0] < topic.partitions:
            what = "is gone" if described is None else f"has {described[0]} partitions"
            raise RunLost(
                f"topic {topic.name} {what}; it had {topic.partitions}: the broker lost the run",
                topic=topic.name,
            )
        return described

    async def _refresh_leaders_quietly(self, topic: ReadTopic) -> None:
        """``_refresh_leaders`` within ``_REFRESH_S``; a broker that does not answer leaves the
        leaders as they are (``RunLost`` still goes through)."""
        with contextlib.suppress(BackendUnavailable, TimeoutError):
            async with asyncio.timeout(_REFRESH_S):
                await self._refresh_leaders(topic)

    async def _refresh_leaders(self, topic: ReadTopic) -> None:
        """New leaders where partitions moved; ``RunLost`` when the topic is gone."""
        described = await self._check_exists(topic)
        if described[0] >= topic.partitions:
            topic.leaders[:] = described[1][: topic.partitions]


def check_partition(topic: ReadTopic, partition: int) -> None:
    if not 0 <= partition < topic.partitions:
        raise InvalidRequest(
            f"partition {partition} out of range: {topic.name} has {topic.partitions}",
            topic=topic.name,
        )
