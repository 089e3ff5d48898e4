"""The Kafka log backend: one topic per run, ``{topic_prefix}{run}``, on any Kafka-protocol broker.

Appends go through aiokafka producers with ``acks="all"``, idempotent where the broker grants
producer ids (detected once at start). Every record carries its partition explicitly: the
interface has already computed Kafka's murmur2 partition of its episode key. Partition ``p`` is
always written by producer ``p % producers`` (its lane), which keeps each partition's order while
two producers keep two produce requests in flight: aiokafka has only one per producer and broker,
so with one producer the client's encoding and the broker's work take turns instead of
overlapping (measured on Tansu: 350 KB records go from ~110 to ~155 MB/s with two).

Each lane has a writer task that coalesces the records of every append waiting at that moment
into one record batch per partition, so everything queued during a round trip leaves in the next
request (``_kafka_writes``). An append resolves once each of its records is acknowledged, with
the offsets of the produce acknowledgements. Sizes are checked before anything is sent; a broker failure after that
can still leave part of a batch written (Kafka has no atomic multi-partition write without
transactions, which Tansu lacks): events carry ``seq`` so that a retry's duplicates are dropped.

Reads use raw Fetch requests, not a consumer (see ``_kafka_wire``): from the requested offset to
the known end of the range, fetching the next page while the caller consumes the current one.
The fetch high-water mark only stops a read whose range reaches beyond what exists; ``ListOffsets``
is never trusted for the end of a partition (Tansu answers the last batch's base offset + 1).

Brokers differ (measured on Tansu 0.6): no producer ids (``InitProducerId`` fails), no
``DeleteRecords`` (the broker drops the connection), short ``ListOffsets``, and auto-creation of
any topic a metadata request mentions. This backend degrades to a plain producer, reports
``trim`` as unsupported, and asks for metadata with ``allow_auto_topic_creation=False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiokafka.client
import aiokafka.errors as kafka_errors
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.metadata import MetadataRequest

from rolloutlog.errors import (
    BackendUnavailable,
    ConfigurationError,
    InvalidRequest,
    LogError,
    UnknownRun,
)
from rolloutlog.log._interface import (
    DEFAULT_MAX_RECORD_BYTES,
    DEFAULT_PARTITIONS,
    Log,
    Position,
    Record,
    check_partitions,
    check_run_name,
)
from rolloutlog.log._kafka_admin import KafkaAdmin
from rolloutlog.log._kafka_reads import KafkaReads, ReadTopic
from rolloutlog.log._kafka_security import OPTIONS, KafkaSecurity, public_url
from rolloutlog.log._kafka_wire import (
    LATEST,
    REQUEST_ERRORS,
    ByteBudget,
    ClientPool,
    describe,
    fetch,
    list_offsets,
    parse_records,
    send,
    translate,
)
from rolloutlog.log._kafka_writes import KafkaWrites, Lane, Topic, dead

__all__ = ["KafkaLog", "from_url"]

log = logging.getLogger(__name__)

DEFAULT_TOPIC_PREFIX = "rolloutlog."
#: Kafka topic names are at most 249 of ``[a-zA-Z0-9._-]``; run names take up to 100.
_TOPIC_PREFIX = re.compile(r"[a-zA-Z0-9._-]{0,140}")
#: Room for a record's key, headers and its batch's header beyond the value itself.
_RECORD_OVERHEAD = 64 * 1024
_BACKOFF_S = 0.05


class _MetadataRequest(MetadataRequest):  # type: ignore[misc]
    """aiokafka's clients ask for metadata with ``allow_auto_topic_creation`` on, so a broker
    that lost a topic (Tansu restarted empty) recreates it, empty, as soon as a producer
    refreshes its metadata, and appends then land at offsets the lost records had. This
    backend creates topics in ``ensure_run`` only: the clients' requests never allow it."""

    def __init__(
        self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = None
    ) -> None:
        super().__init__(topics, bool(allow_auto_topic_creation))


# aiokafka builds these requests inside ``AIOKafkaClient._metadata_update`` with no setting for it.
aiokafka.client.MetadataRequest = _MetadataRequest


class KafkaLog(KafkaAdmin, KafkaReads, KafkaWrites, Log):
    """The log on a Kafka-protocol broker; one topic ``{topic_prefix}{run}`` per run.

    Options: ``idempotence`` None detects (True requires, False never asks);
    ``replication_factor`` of new topics, by default min(3, brokers); ``producers`` (lanes, see
    the module notes); ``batch_bytes`` per record batch (a larger record travels alone);
    ``in_flight_bytes`` handed to the producers and not yet acknowledged; ``fetch_bytes`` per
    read page (grown when a batch does not fit); ``read_connections`` kept open between reads;
    ``security``: TLS and SASL of every connection (``_kafka_security``).
    """

    #: A read's first Fetch is a round trip to the broker (20-45 ms for a 4 MiB page on Tansu).
    read_ahead = True

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        topic_prefix: str = DEFAULT_TOPIC_PREFIX,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        idempotence: bool | None = None,
        replication_factor: int | None = None,
        producers: int = 2,
        batch_bytes: int = 1024 * 1024,
        in_flight_bytes: int = 64 * 1024 * 1024,
        fetch_bytes: int = 4 * 1024 * 1024,
        read_connections: int = 4,
        request_timeout_ms: int = 30_000,
        client_id: str = "rolloutlog",
        url: str | None = None,
        security: KafkaSecurity | None = None,
    ) -> None:
        if max_record_bytes < 1:
            raise ConfigurationError("max_record_bytes must be positive")
        if not _TOPIC_PREFIX.fullmatch(topic_prefix):
            raise ConfigurationError(
                f"topic_prefix {topic_prefix!r}: at most 140 of letters, digits and '._-'"
            )
        if read_connections < 1 or producers < 1:
            raise ConfigurationError("producers and read_connections must be at least 1")
        self.url = public_url(url) if url else f"kafka://{bootstrap_servers}"
        self.security = security or KafkaSecurity()
        #: TLS and SASL options of every client (one SSL context for all connections).
        self._connect = self.security.client_options()
        self.bootstrap_servers = bootstrap_servers
        self.topic_prefix = topic_prefix
        self.max_record_bytes = max_record_bytes
        self.replication_factor = replication_factor
        #: Whether appends use an idempotent producer; known once started.
        self.idempotent = False
        self._idempotence = idempotence
        self._batch_bytes = batch_bytes
        #: The largest batch the topic must accept: a full batch, or one record alone.
        self._max_message_bytes = max(max_record_bytes, batch_bytes) + _RECORD_OVERHEAD
        self._fetch_bytes = max(1024, fetch_bytes)
        self._request_timeout_ms = request_timeout_ms
        self._client_id = client_id
        self._budget = ByteBudget(max(in_flight_bytes, 1))
        self._read_connections = read_connections
        self._readers = ClientPool(self._new_client, read_connections)
        #: Followers of a topic, woken by this instance's acks.
        self._wakers: dict[tuple[str, int], set[asyncio.Event]] = {}
        self._admin: Any = None
        self._control: Any = None
        self._producer_count = producers
        self._producers: list[Any] = []
        self._topics: dict[str, Topic] = {}
        self._create_lock = asyncio.Lock()
        self._replace_lock = asyncio.Lock()
        #: None until the first trim tells whether the broker implements DeleteRecords.
        self._trim_supported: bool | None = None
        self._closing = False

    # -- lifecycle -------------------------------------------------------------------------------

    def _new_client(self) -> Any:
        return AIOKafkaClient(
            bootstrap_servers=self.bootstrap_servers,
            client_id=self._client_id,
            request_timeout_ms=self._request_timeout_ms,
            **self._connect,
        )

    async def start(self) -> None:
        self._closing = False
        self._readers = ClientPool(self._new_client, self._read_connections)
        try:
            self._admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                client_id=self._client_id,
                request_timeout_ms=self._request_timeout_ms,
                **self._connect,
            )
            await self._admin.start()
            self._control = self._new_client()
            await self._control.bootstrap()
            self._producers.append(await self._start_producer())
            while len(self._producers) < self._producer_count:
                producer = self._new_producer(self.idempotent)
                self._producers.append(producer)
                await producer.start()
        except Exception as e:
            await self.close()
            refused = await self.security.diagnose(self.bootstrap_servers)
            if refused is not None:
                raise ConfigurationError(refused) from None
            raise translate(e, f"connect to {self.bootstrap_servers}") from e
        except BaseException:
            await self.close()
            raise
        log.info("kafka log %s: connected (%s)", self.url, self.security.describe())

    def _new_producer(self, idempotent: bool) -> Any:
        return AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            client_id=self._client_id,
            acks="all",
            enable_idempotence=idempotent,
            max_batch_size=self._batch_bytes,
            max_request_size=self._max_message_bytes,
            request_timeout_ms=self._request_timeout_ms,
            linger_ms=0,
            **self._connect,
        )

    async def _start_producer(self) -> Any:
        """An idempotent producer where the broker grants producer ids, else a plain one.

        The broker is asked once, by starting an idempotent producer: its ``InitProducerId``
        either succeeds, fails with an error code (Tansu answers UNKNOWN_SERVER_ERROR), or loses
        its connection and retries forever, which the timeout cuts short.
        """
        if self._idempotence is not False:
            producer = self._new_producer(idempotent=True)
            try:
                async with asyncio.timeout(min(self._request_timeout_ms / 1000, 15)):
                    await producer.start()
            except (kafka_errors.KafkaError, TimeoutError) as e:
                await producer.stop()
                if isinstance(e, kafka_errors.KafkaConnectionError):
                    raise  # the broker is unreachable: not a question of idempotence
                if self._idempotence:
                    raise LogError(
                        f"the broker at {self.bootstrap_servers} refuses idempotent producers: {e}"
                    ) from e
                log.warning(
                    "kafka log %s: no idempotent producer (%s: %s); appends use a plain "
                    "producer (acks=all), so a retried append may be written twice",
                    self.bootstrap_servers,
                    type(e).__name__,
                    e,
                )
            else:
                self.idempotent = True
                log.info("kafka log %s: idempotent producer", self.bootstrap_servers)
                return producer
        producer = self._new_producer(idempotent=False)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        self.idempotent = False
        return producer

    async def close(self) -> None:
        self._closing = True
        writers = [
            lane.writer
            for topic in self._topics.values()
            for lane in topic.lanes
            if lane.writer is not None
        ]
        if writers:
            await asyncio.gather(*writers, return_exceptions=True)
        producers, self._producers = self._producers, []
        for producer in producers:
            await producer.stop()  # flushes: pending appends finish first
        await self._readers.close()
        control, self._control = self._control, None
        if control is not None:
            await control.close()
        admin, self._admin = self._admin, None
        if admin is not None:
            await admin.close()
        self._topics.clear()

    def _require_started(self) -> None:
        if not self._producers or self._closing:
            raise LogError(f"the kafka log {self.url} is not started")

    async def ping(self) -> None:
        self._require_started()
        await self._control_send(MetadataRequest([], allow_auto_topic_creation=False), "ping")

    # -- topics ----------------------------------------------------------------------------------

    def topic_name(self, run: str) -> str:
        """The Kafka topic that holds ``run``."""
        return f"{self.topic_prefix}{run}"

    async def _control_send(self, request: Any, what: str) -> Any:
        client = self._control
        node = client.get_random_node()
        if node is None:
            raise BackendUnavailable(f"{what}: no broker of {self.bootstrap_servers} is known")
        try:
            async with asyncio.timeout(self._request_timeout_ms / 1000):
                return await send(client, node, request)
        except (kafka_errors.KafkaError, OSError, TimeoutError) as e:
            raise translate(e, f"{what} ({self.bootstrap_servers})") from e

    async def _describe(self, name: str) -> tuple[int, list[int]] | None:
        """Partition count and leaders of a topic; None when it does not exist.

        Asks with ``allow_auto_topic_creation=False``: aiokafka's own metadata requests let the
        broker create a topic they merely mention (Tansu does, with its default partitions).
        """
        request = MetadataRequest([name], allow_auto_topic_creation=False)
        response = await self._control_send(request, f"describe topic {name}")
        return describe(response, name)

    async def _read_topic(self, run: str) -> ReadTopic:
        return await self._topic(run)

    async def _topic(self, run: str) -> Topic:
        topic = self._topics.get(run)
        if topic is not None:
            return topic
        self._require_started()
        check_run_name(run)
        name = self.topic_name(run)
        described = await self._describe(name)
        if described is None:
            raise UnknownRun(f"run {run!r} has no topic {name!r}", run=run)
        count, leaders = described
        if count == 0 or min(leaders) < 0:
            count, leaders = await self._await_leaders(name, count)
        return await self._register(run, name, count, leaders)

    async def _register(self, run: str, name: str, count: int, leaders: list[int]) -> Topic:
        existing = self._topics.get(run)
        if existing is not None:
            return existing
        for producer in self._producers:
            await self._producer_knows(producer, name, count)
        lanes = [Lane(index) for index in range(len(self._producers))]
        return self._topics.setdefault(run, Topic(name, count, leaders, [-1] * count, lanes))

    async def _producer_knows(self, producer: Any, name: str, count: int) -> None:
        """A producer checks explicit partitions against its own metadata: make sure it has seen
        all ``count`` before it takes a batch for the topic."""
        deadline = time.monotonic() + self._request_timeout_ms / 1000
        while True:
            try:
                known = await producer.partitions_for(name)
            except kafka_errors.KafkaError as e:
                raise translate(e, f"metadata of {name}") from e
            if len(known) >= count or time.monotonic() > deadline:
                return
            await producer.client.force_metadata_update()
            await asyncio.sleep(_BACKOFF_S)

    async def _producer(self, index: int) -> Any:
        """Producer ``index``, replaced first if it died.

        aiokafka's sender task can die of an error it does not expect (under uvloop, a write to
        a connection the broker reset raises RuntimeError), and then fails every later batch:
        only a new producer recovers, without restarting the service."""
        producer = self._producers[index]
        if not dead(producer):
            return producer
        async with self._replace_lock:
            producer = self._producers[index]
            if not dead(producer):
                return producer
            log.warning("kafka log %s: producer %d died; starting a new one", self.url, index)
            fresh = self._new_producer(self.idempotent)
            try:
                async with asyncio.timeout(self._request_timeout_ms / 1000):
                    await fresh.start()
                    for topic in list(self._topics.values()):
                        await self._producer_knows(fresh, topic.name, topic.partitions)
            except Exception as e:
                await fresh.stop()
                raise translate(e, f"restart producer {index} ({self.bootstrap_servers})") from e
            self._producers[index] = fresh
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._request_timeout_ms / 1000):
                    await producer.stop()
            return fresh

    async def _await_leaders(self, name: str, expected: int) -> tuple[int, list[int]]:
        """Poll metadata until the topic shows at least ``expected`` partitions, all led."""
        deadline = time.monotonic() + self._request_timeout_ms / 1000
        while True:
            described = await self._describe(name)
            if described is not None:
                count, leaders = described
                if count >= max(expected, 1) and min(leaders) >= 0:
                    return count, leaders
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"topic {name!r} has no leader for every partition after "
                    f"{self._request_timeout_ms} ms",
                    topic=name,
                )
            await asyncio.sleep(_BACKOFF_S)

    async def ensure_run(self, run: str, partitions: int = DEFAULT_PARTITIONS) -> int:
        check_run_name(run)
        known = self._topics.get(run)
        if known is not None:
            return known.partitions
        self._require_started()
        name = self.topic_name(run)
        async with self._create_lock:
            known = self._topics.get(run)
            if known is not None:
                return known.partitions
            described = await self._describe(name)
            if described is None:
                check_partitions(partitions)  # new topics only: older, wider ones still open
                created = await self._create_topic(name, partitions)
                # Someone else's concurrent creation wins, with whatever partitions it chose.
                expected = partitions if created else 1
            else:
                expected = described[0]
            count, leaders = await self._await_leaders(name, expected)
            return (await self._register(run, name, count, leaders)).partitions

    async def partitions(self, run: str) -> int:
        return (await self._topic(run)).partitions

    # -- appends ---------------------------------------------------------------------------------

    async def append_records(self, run: str, records: Sequence[Record]) -> list[Position]:
        topic = await self._topic(run)
        if not records:
            return []
        if topic.suspect:
            await self._check_exists(topic)  # RunLost when it is gone
            topic.suspect = False
        for index, record in enumerate(records):
            if not 0 <= record.partition < topic.partitions:
                raise InvalidRequest(
                    f"record {index}: partition {record.partition} out of range", run=run
                )
        self.check_records(records)
        self._require_started()
        return await self._hand_over(topic, records)

    # -- ends and trimming -----------------------------------------------------------------------

    async def end_offsets(self, run: str) -> list[int]:
        """The next offset of every partition: from this instance's produce acknowledgements
        where it wrote to the partition, else observed on the broker.

        Observed means: ``ListOffsets`` latest as a lower bound (exact on Apache Kafka, possibly
        short on Tansu), then one Fetch from there, whose high-water mark (and last record) gives
        the end. Partitions this instance wrote are not re-read: other writers' later records
        are not counted, which is the contract ("as far as this log instance knows it").
        """
        topic = await self._topic(run)
        ends = list(topic.acked_ends)
        unknown = [partition for partition, end in enumerate(ends) if end < 0]
        if unknown:
            observed = await self._observed_ends(self._control, topic, unknown)
            for partition, end in zip(unknown, observed, strict=True):
                ends[partition] = end
        return ends

    async def latest_offsets(self, run: str) -> list[int]:
        """Every partition observed on the broker (``end_offsets`` skips the partitions this
        instance wrote, whose later records by other writers it does not count)."""
        topic = await self._topic(run)
        partitions = list(range(len(topic.acked_ends)))
        observed = await self._observed_ends(self._control, topic, partitions)
        return [max(acked, seen) for acked, seen in zip(topic.acked_ends, observed, strict=True)]

    async def _observed_ends(self, client: Any, topic: Topic, partitions: list[int]) -> list[int]:
        where = f"end offsets of {topic.name}"
        deadline = time.monotonic() + self._request_timeout_ms / 1000
        try:
            ends = await list_offsets(client, topic.name, topic.leaders, partitions, LATEST)
            # Tansu's LATEST may fall short: fetch from it and take the high-water mark. An
            # empty partition (LATEST 0) needs no fetch on either broker.
            unsure = {p: ends.get(p, 0) for p in partitions if ends.get(p, 0) > 0}
            while unsure:
                answers = await fetch(client, topic.name, topic.leaders, unsure, 64 * 1024)
                for partition, answer in answers.items():
                    if answer.error is kafka_errors.NoError:
                        records = parse_records(answer.data, unsure[partition], 1 << 62).records
                        last = records[-1][0] + 1 if records else 0
                        ends[partition] = max(unsure[partition], answer.highwater, last)
                        del unsure[partition]
                    elif not answer.error.retriable:
                        raise answer.error(where)
                if unsure:
                    if time.monotonic() > deadline:
                        raise BackendUnavailable(f"{where}: no answer for {sorted(unsure)}")
                    await self._refresh_leaders(topic)
                    await asyncio.sleep(_BACKOFF_S)
        except REQUEST_ERRORS as e:
            raise translate(e, where, topic=topic.name) from e
        return [ends.get(partition, 0) for partition in partitions]


def _flag(value: str) -> bool | None:
    lowered = value.lower()
    if lowered in {"auto", ""}:
        return None
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigurationError(f"not a boolean or 'auto': {value!r}")


def from_url(url: str, **options: Any) -> KafkaLog:
    """``kafka://host:port[,host:port]`` with optional query settings ``topic_prefix``,
    ``max_record_bytes``, ``idempotence`` (``auto``/``true``/``false``), ``replication_factor``,
    ``read_connections`` and ``request_timeout_ms``, and the TLS and SASL ones of
    ``_kafka_security.OPTIONS`` (``security_protocol``, ``sasl_mechanism``,
    ``sasl_username[_file]``, ``sasl_password[_file]``, ``ssl_cafile``, ``ssl_certfile``,
    ``ssl_keyfile``, ``ssl_check_hostname``); keyword options win over the query."""
    parts = urlsplit(url)
    if "@" in parts.netloc:  # the URL is not echoed: it holds a password
        raise ConfigurationError(
            "kafka log URL: no credentials before the host; give sasl_username and "
            "sasl_password (or their _file variants) in the query or the settings"
        )
    if parts.scheme != "kafka" or not parts.netloc:
        raise ConfigurationError(
            f"kafka log URL must be kafka://host:port[,host:port]: {public_url(url)!r}"
        )
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    secure = {key: query.pop(key) for key in list(query) if key in OPTIONS}
    secure.update({key: options.pop(key) for key in list(options) if key in OPTIONS})
    if "security" not in options:
        options["security"] = KafkaSecurity.from_options(secure)
    converters: dict[str, Any] = {
        "topic_prefix": str,
        "max_record_bytes": int,
        "idempotence": _flag,
        "replication_factor": int,
        "producers": int,
        "read_connections": int,
        "request_timeout_ms": int,
    }
    for key, value in query.items():
        convert = converters.get(key)
        if convert is None:
            raise ConfigurationError(f"unknown kafka log URL setting {key!r}")
        try:
            options.setdefault(key, convert(value))
        except ValueError as e:
            raise ConfigurationError(f"kafka log URL setting {key}={value!r}: {e}") from e
    return KafkaLog(parts.netloc, url=url, **options)
