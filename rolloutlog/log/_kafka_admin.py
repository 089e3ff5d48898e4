"""The admin side of ``KafkaLog``: creating a run's topic, trimming a partition, deleting a run
(a mixin: the log supplies the attributes below)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiokafka.errors as kafka_errors
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic, RecordsToDelete

from rolloutlog.errors import BackendUnavailable, LogError
from rolloutlog.log._interface import check_run_name
from rolloutlog.log._kafka_reads import check_partition
from rolloutlog.log._kafka_wire import translate
from rolloutlog.log._kafka_writes import Topic

__all__ = ["KafkaAdmin"]

log = logging.getLogger("rolloutlog.log.kafka")

_BACKOFF_S = 0.05


class KafkaAdmin:
    """Topic creation, ``DeleteRecords`` and ``DeleteTopics`` of ``KafkaLog``."""

    bootstrap_servers: str
    replication_factor: int | None
    _admin: Any
    _control: Any
    _topics: dict[str, Topic]
    _trim_supported: bool | None
    _max_message_bytes: int
    _request_timeout_ms: int

    def topic_name(self, run: str) -> str:
        raise NotImplementedError

    def _require_started(self) -> None:
        raise NotImplementedError

    async def ping(self) -> None:
        raise NotImplementedError

    async def _topic(self, run: str) -> Topic:
        raise NotImplementedError

    async def _describe(self, name: str) -> tuple[int, list[int]] | None:
        raise NotImplementedError

    async def _create_topic(self, name: str, partitions: int) -> bool:
        """Create the topic: True, or False when it exists already (someone else was first)."""
        replication = self.replication_factor
        if replication is None:
            replication = min(3, max(1, len(self._control.cluster.brokers())))
        configs: dict[str, str] = {"max.message.bytes": str(self._max_message_bytes)}
        while True:
            topic = NewTopic(name, partitions, replication, topic_configs=configs)
            try:
                response = await self._admin.create_topics([topic])
            except kafka_errors.KafkaError as e:
                raise translate(e, f"create topic {name}", topic=name) from e
            # (topic, error_code[, error_message]) depending on the version
            answer = next((entry for entry in response.topic_errors if entry[0] == name), None)
            if answer is None:
                raise LogError(f"create topic {name}: the broker did not answer for it")
            error = kafka_errors.for_code(answer[1])
            message = answer[2] if len(answer) > 2 else None
            if error is kafka_errors.NoError:
                return True
            if error is kafka_errors.TopicAlreadyExistsError:
                return False
            if configs and error in (
                kafka_errors.InvalidConfigurationError,
                kafka_errors.PolicyViolationError,
            ):
                # The broker will not take the topic setting: create without it, and rely on
                # its own message.max.bytes (records above it are refused as payload_too_large).
                log.warning(
                    "kafka log: broker refused max.message.bytes=%s for %s (%s); "
                    "creating the topic without it",
                    configs["max.message.bytes"],
                    name,
                    message,
                )
                configs = {}
                continue
            raise translate(error(message), f"create topic {name}", topic=name)

    async def trim(self, run: str, partition: int, before: int) -> bool:
        """``DeleteRecords`` below ``before`` (clamped to the high-water mark); False where the
        broker does not implement it (Tansu closes the connection), decided once per instance."""
        topic = await self._topic(run)
        check_partition(topic, partition)
        if self._trim_supported is False:
            return False
        target = TopicPartition(topic.name, partition)
        offset = max(before, 0)
        for _ in range(2):
            try:
                await self._admin.delete_records(
                    {target: RecordsToDelete(offset)}, timeout_ms=self._request_timeout_ms
                )
            except kafka_errors.OffsetOutOfRangeError:
                offset = -1  # beyond the high-water mark: DeleteRecords' "up to the end"
                continue
            except (
                kafka_errors.KafkaConnectionError,
                kafka_errors.NodeNotReadyError,
                kafka_errors.RequestTimedOutError,
                kafka_errors.UnsupportedVersionError,
                kafka_errors.IncompatibleBrokerVersion,
            ) as e:
                await self.ping()  # still reachable: the broker refused this request alone
                log.warning(
                    "kafka log %s: the broker does not implement DeleteRecords (%s); "
                    "trim is a no-op",
                    self.bootstrap_servers,
                    type(e).__name__,
                )
                self._trim_supported = False
                return False
            except kafka_errors.KafkaError as e:
                raise translate(e, f"trim {topic.name}[{partition}]", topic=topic.name) from e
            self._trim_supported = True
            return True
        raise LogError(f"trim {topic.name}[{partition}] below {before} failed", topic=topic.name)

    async def delete_run(self, run: str) -> bool:
        """``DeleteTopics`` on the run's topic; False when it had none. Later appends to the run
        fail with ``UnknownRun``; a later ``ensure_run`` creates the topic afresh."""
        self._require_started()
        check_run_name(run)
        name = self.topic_name(run)
        self._topics.pop(run, None)
        try:
            response = await self._admin.delete_topics([name], timeout_ms=self._request_timeout_ms)
        except kafka_errors.KafkaError as e:
            raise translate(e, f"delete topic {name}", topic=name) from e
        # (topic, error_code[, error_message]) depending on the version
        answer = next((entry for entry in response.topic_error_codes if entry[0] == name), None)
        error = kafka_errors.for_code(answer[1]) if answer is not None else None
        if error is kafka_errors.UnknownTopicOrPartitionError:
            return False
        if error is not kafka_errors.NoError:
            raise LogError(f"delete topic {name}: {error}", topic=name)
        # Deletion is asynchronous on Kafka: wait until metadata no longer lists the topic, so
        # that a run created again under the name gets a new, empty one.
        deadline = time.monotonic() + self._request_timeout_ms / 1000
        while await self._describe(name) is not None:
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"delete topic {name}: it is still listed", topic=name)
            await asyncio.sleep(_BACKOFF_S)
        return True
