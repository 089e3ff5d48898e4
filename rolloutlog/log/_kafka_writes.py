"""Appends of the Kafka log backend (``KafkaLog``'s write side; the lanes are described in
``kafka``'s notes): one writer task per lane and topic while records wait, batches built per
partition, and the produce acknowledgements turned into positions. A produce acknowledged below
a partition's acknowledged end means the broker lost records (it restarted empty): those records
are refused with ``RunLost``, never acknowledged."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiokafka.errors as kafka_errors

from rolloutlog.errors import BackendUnavailable, RunLost
from rolloutlog.log._interface import Position, Record
from rolloutlog.log._kafka_reads import ReadTopic
from rolloutlog.log._kafka_wire import ByteBudget, chained


@dataclass(eq=False, slots=True)
class _Append:
    """One ``append_records`` call: resolved once its last record is acknowledged."""

    records: Sequence[Record]
    future: asyncio.Future[list[Position]]
    offsets: list[int]
    remaining: int

    def acknowledged(self, indexes: Sequence[int], offset: int) -> int:
        """Records ``indexes`` landed at ``offset`` onwards; returns the offset after them."""
        offsets = self.offsets
        for index in indexes:
            offsets[index] = offset
            offset += 1
        self.remaining -= len(indexes)
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(
                [
                    Position(record.partition, at)
                    for record, at in zip(self.records, offsets, strict=True)
                ]
            )
        return offset

    def fail(self, error: BaseException, topic: str) -> None:
        if not self.future.done():
            self.future.set_exception(chained(error, f"append to {topic}", topic=topic))


#: Some records of one append (their indexes in it), bound for one lane.
_Share = tuple[_Append, Sequence[int]]
#: Consecutive records of one batch that came from one append.
_Run = tuple[_Append, list[int]]


@dataclass(eq=False)
class Lane:
    """One producer's share of a topic: the records waiting for it, and the task handing them
    over (it exists while there are any)."""

    #: Which of the log's producers writes this lane's records.
    index: int
    pending: list[_Share] = field(default_factory=list)
    writer: asyncio.Task[None] | None = None


@dataclass(eq=False)
class Topic(ReadTopic):
    """What this instance knows of one run's topic."""

    #: Partition ``p`` is written through ``lanes[p % len(lanes)]`` only, which keeps its order.
    lanes: list[Lane]
    #: A produce failed since the topic was last seen: look it up before the next append, so
    #: that a lost topic refuses appends at once instead of after the producer's retries.
    suspect: bool = False


class KafkaWrites:
    """The write side of ``KafkaLog`` (a mixin: the log supplies the attributes below)."""

    _budget: ByteBudget
    #: Followers to wake by (topic, partition); partition -1 wakes a whole run's follower.
    _wakers: dict[tuple[str, int], set[asyncio.Event]]

    async def _producer(self, index: int) -> Any:
        raise NotImplementedError

    async def _hand_over(self, topic: Topic, records: Sequence[Record]) -> list[Position]:
        """Queue checked ``records`` on their lanes; their positions once all are acknowledged."""
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        append = _Append(records, future, [0] * len(records), len(records))
        lanes = topic.lanes
        if len(lanes) == 1:
            self._enqueue(topic, lanes[0], append, range(len(records)))
        else:
            shares: list[list[int]] = [[] for _ in lanes]
            for index, record in enumerate(records):
                shares[record.partition % len(lanes)].append(index)
            for lane, share in zip(lanes, shares, strict=True):
                if share:
                    self._enqueue(topic, lane, append, share)
        return await future

    def _enqueue(self, topic: Topic, lane: Lane, append: _Append, indexes: Sequence[int]) -> None:
        lane.pending.append((append, indexes))
        if lane.writer is None:
            lane.writer = asyncio.create_task(self._write(topic, lane), name=f"write {topic.name}")

    async def _write(self, topic: Topic, lane: Lane) -> None:
        """Hand everything pending in ``lane`` to its producer, one batch per partition."""
        try:
            await asyncio.sleep(0)  # appends made in the same loop turn join this round
            while lane.pending:
                pending, lane.pending = lane.pending, []
                try:
                    producer = await self._producer(lane.index)
                    batches = self._build_batches(producer, pending)
                except Exception as e:  # no producer, or a record the batch builder refuses
                    for append, _ in pending:
                        append.fail(e, topic.name)
                    continue
                for partition, builder, members in batches:
                    await self._submit(topic, producer, partition, builder, members)
        finally:
            lane.writer = None

    @staticmethod
    def _build_batches(producer: Any, pending: list[_Share]) -> list[tuple[int, Any, list[_Run]]]:
        """Closed record batches in submission order (per partition, the order records came in),
        each with the runs of appends whose records it holds, in batch order."""
        timestamp = int(time.time() * 1000)
        ready: list[tuple[int, Any, list[_Run]]] = []
        open_batches: dict[int, tuple[Any, list[_Run]]] = {}
        create_batch = producer.create_batch
        for append, indexes in pending:
            records = append.records
            for index in indexes:
                record = records[index]
                partition = record.partition
                current = open_batches.get(partition)
                if current is None:
                    current = open_batches[partition] = (create_batch(), [])
                builder, members = current
                if builder.append(timestamp=timestamp, key=record.key, value=record.value) is None:
                    # Full. A fresh batch always takes its first record, however large.
                    ready.append((partition, builder, members))
                    current = open_batches[partition] = (create_batch(), [])
                    builder, members = current
                    builder.append(timestamp=timestamp, key=record.key, value=record.value)
                if members and members[-1][0] is append:
                    members[-1][1].append(index)
                else:
                    members.append((append, [index]))
        ready.extend(
            (partition, builder, members) for partition, (builder, members) in open_batches.items()
        )
        for _, builder, _ in ready:
            builder.close()
        return ready

    async def _submit(
        self, topic: Topic, producer: Any, partition: int, builder: Any, members: list[_Run]
    ) -> None:
        granted = await self._budget.acquire(builder.size())
        try:
            # Waits while this partition's previous batch is still queued in the producer.
            acked = await producer.send_batch(builder, topic.name, partition=partition)
        except Exception as e:  # closed producer, stale metadata: these records fail
            self._budget.release(granted)
            topic.suspect = True
            error: BaseException = _producer_error(producer, e)
            if isinstance(e, kafka_errors.UnknownTopicOrPartitionError):
                error = _lost(topic, partition, "the broker no longer knows the topic")
            for append, _ in members:
                append.fail(error, topic.name)
            return
        acked.add_done_callback(
            functools.partial(self._acknowledged, topic, producer, partition, members, granted)
        )

    def _acknowledged(
        self,
        topic: Topic,
        producer: Any,
        partition: int,
        members: list[_Run],
        granted: int,
        acked: asyncio.Future[Any],
    ) -> None:
        self._budget.release(granted)
        if acked.cancelled():
            error: BaseException | None = BackendUnavailable("the produce request was cancelled")
        else:
            error = acked.exception()
            if error is not None:
                topic.suspect = True
                error = _producer_error(producer, error)
        if isinstance(error, kafka_errors.UnknownTopicOrPartitionError):
            error = _lost(topic, partition, "the broker no longer knows the topic")
        if error is None and acked.result().offset < topic.acked_ends[partition]:
            # Written below what this instance had acknowledged: the broker lost the partition's
            # records and took these at offsets that named others. Not acknowledged.
            error = _lost(
                topic,
                partition,
                f"records landed at {acked.result().offset}, below the acknowledged end "
                f"{topic.acked_ends[partition]}",
            )
        if error is not None:
            for append, _ in members:
                append.fail(error, topic.name)
            return
        offset = acked.result().offset
        for append, indexes in members:
            offset = append.acknowledged(indexes, offset)
        if offset > topic.acked_ends[partition]:
            topic.acked_ends[partition] = offset
        for key in ((topic.name, partition), (topic.name, -1)):
            for waker in self._wakers.get(key, ()):
                waker.set()


def dead(producer: Any) -> bool:
    """Whether a started producer's sender task has ended (aiokafka exposes no public check)."""
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    return task is not None and task.done()


def _producer_error(producer: Any, error: BaseException) -> BaseException:
    """A batch that failed because its producer died is refused as retriable: the next append
    gets a new producer."""
    if dead(producer) and not isinstance(error, BackendUnavailable):
        unavailable = BackendUnavailable(f"the producer failed ({error!r}); it is being replaced")
        unavailable.__cause__ = error
        return unavailable
    return error


def _lost(topic: Topic, partition: int, why: str) -> RunLost:
    return RunLost(
        f"{topic.name}[{partition}]: {why}: the broker lost the run's records (restarted empty?)",
        topic=topic.name,
        partition=partition,
    )
