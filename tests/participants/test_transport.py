"""The HTTP transport's pipeline: idempotent retries, back-pressure, coalescing, fencing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from rolloutlog.errors import AttemptFenced, BackendUnavailable, InvalidEvent, PayloadTooLarge
from rolloutlog.log import Position
from rolloutlog.participants import (
    Environment,
    HttpTransport,
    Policy,
    RolloutContext,
    fingerprint,
)
from rolloutlog.participants._http1 import Http1Connection
from rolloutlog.participants._transport import _Pending
from rolloutlog.trainer import AsyncTrainerClient
from rolloutlog.wire import SERVICE_KEEPALIVE_S, direct_http_url
from tests._services import free_port
from tests.api.conftest import TOKENS
from tests.api.test_e2e import Server, running_server
from tests.participants.conftest import RUN, World


class Interposer(httpx.AsyncBaseTransport):
    """Forwards to the app; can hold event appends at a gate and lose responses after the
    service appended (the case a retry must keep idempotent)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.gate.set()
        self.arrived = asyncio.Event()
        self.lose = 0
        self.batches: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/events"):
            return await self.inner.handle_async_request(request)
        body = await request.aread()
        self.batches.append(body.count(b"\n") + 1)
        self.arrived.set()
        await self.gate.wait()
        response = await self.inner.handle_async_request(request)
        if self.lose:
            self.lose -= 1
            await response.aread()
            raise httpx.ReadError("the connection dropped before the reply")
        return response


async def settle() -> None:
    """Let every runnable task run until it blocks (no clock involved)."""
    for _ in range(50):
        await asyncio.sleep(0)


def interposed(world: World, **options: object) -> tuple[Interposer, HttpTransport]:
    interposer = Interposer(world.api.client._transport)
    client = httpx.AsyncClient(transport=interposer, base_url="http://rolloutlog.test")
    transport = HttpTransport(client=client, token=TOKENS["participant"], **options)  # type: ignore[arg-type]
    return interposer, transport


async def test_a_retried_append_is_folded_once(world: World) -> None:
    interposer, transport = interposed(world, backoff_s=0.001)
    async with transport, transport._rest.client:
        env = Environment(transport, RUN, "env-0")
        policy = Policy(transport, RUN, "policy-0")
        await env.register()
        await policy.register()
        episode = await env.start_episode("e1", {"prompt": "p"})
        interposer.lose = 1
        await policy.record_call(
            "e1", "c1", [1, 2], fingerprint=fingerprint([1]), context_digest="x"
        )
        assert transport.stats.retries == 1
        await episode.boundary("seed", {"turn": 1})
    checkpoint = await world.trainer.checkpoint(RUN)
    path = f"/v1/runs/{RUN}/episodes/e1/projection?checkpoint={checkpoint.checkpoint_id}"
    projection = (await world.api.call("GET", path, "participant", 200)).json()
    assert [row["call_id"] for row in projection["ledger"]] == ["c1"]
    log = world.api.service.log
    copies = 0
    for partition, end in enumerate(await log.end_offsets(RUN)):
        async for _, record in log.read_records(RUN, partition, 0, end):
            copies += b'"ledger.row"' in record
    assert copies == 2  # in the log twice, folded once (same seq)


async def test_a_full_budget_makes_callers_wait_and_queued_events_coalesce(world: World) -> None:
    interposer, transport = interposed(world, max_in_flight=3)
    async with transport, transport._rest.client:
        env = Environment(transport, RUN, "env-0")
        await env.register()
        episodes = [await env.start_episode(f"e{i}", {"i": i}) for i in range(6)]
        interposer.gate.clear()
        interposer.arrived.clear()
        sent_before = len(interposer.batches)
        tasks = [asyncio.create_task(e.boundary("seed", {"n": 1})) for e in episodes]
        await interposer.arrived.wait()
        await settle()
        assert transport.in_flight == 3
        assert not any(task.done() for task in tasks)
        assert sum(interposer.batches[sent_before:]) <= 3
        interposer.gate.set()
        await asyncio.gather(*tasks)
        batches = interposer.batches[sent_before:]
        assert sum(batches) == 6 and len(batches) < 6
        assert transport.stats.max_queued <= 3 and transport.in_flight == 0


async def test_a_fenced_event_fails_alone_and_its_batch_mates_are_appended(world: World) -> None:
    interposer, transport = interposed(world)
    async with transport, transport._rest.client:
        env = Environment(transport, RUN, "env-0")
        await env.register()
        old = await env.start_episode("e1", {"i": 1})
        await env.start_episode("e2", {"i": 2})
        await world.trainer.checkpoint(RUN)
        await world.trainer.restore(RUN)
        interposer.gate.clear()
        interposer.arrived.clear()
        current = Environment(transport, RUN, "env-0")
        current.epoch, current.seq, current._who = env.epoch, env.seq, env._who
        fenced = asyncio.create_task(old.boundary("seed", {"late": True}))
        fine = asyncio.create_task(
            current.emit(
                "step.started",
                RolloutContext("e2", 1),
                {"owner": "environment", "stage": "seed", "mode": "replay"},
            )
        )
        await interposer.arrived.wait()
        await settle()
        interposer.gate.set()
        with pytest.raises(AttemptFenced):
            await fenced
        assert (await fine).offset >= 0
        assert interposer.batches[-2:] == [2, 1]  # one request refused, the rest sent again


async def test_an_unreachable_service_fails_each_event_at_its_deadline() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    failed: list[tuple[str, object, BaseException]] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://x.test")
    transport = HttpTransport(
        client=client,
        deadline_s=0.3,
        backoff_s=0.001,
        max_backoff_s=0.02,
        on_failure=lambda run, event, error: failed.append((run, event["seq"], error)),
    )
    async with client, transport:
        loop = asyncio.get_running_loop()
        began = loop.time()
        events = [orjson.loads(b'{"type": "x", "episode": "e", "seq": %d}' % n) for n in (1, 2)]
        with pytest.raises(BackendUnavailable):
            await transport.append(RUN, events)
        elapsed = loop.time() - began
        assert 0.3 <= elapsed < 2.0  # retried until the deadline, not after a fixed count
        assert transport.stats.retries >= 5 and transport.in_flight == 0
        # every event's final failure is reported once, in order
        assert [(run, seq) for run, seq, _ in failed] == [(RUN, 1), (RUN, 2)]
        assert all(isinstance(error, BackendUnavailable) for _, _, error in failed)


def test_the_retry_backoff_is_jittered_exponential_and_capped_by_the_deadline() -> None:
    transport = HttpTransport("http://x.test", deadline_s=10.0, backoff_s=0.1, max_backoff_s=2.0)
    loop = asyncio.new_event_loop()
    try:
        transport._loop = loop
        now = loop.time()
        batch = [_Pending(RUN, {}, b"", loop.create_future(), now)]
        for failures, cap in ((1, 0.1), (2, 0.2), (3, 0.4), (6, 2.0), (40, 2.0)):
            delays = {transport._retry_delay(batch, failures) for _ in range(50)}
            assert all(d is not None and cap * 0.5 <= d <= cap for d in delays)
            assert len(delays) > 1  # jittered
        nearly = [_Pending(RUN, {}, b"", loop.create_future(), now - 9.95)]
        delay = transport._retry_delay(nearly, 10)
        assert delay is not None and delay <= 0.05 + 1e-3  # never sleeps past the deadline
        late = [_Pending(RUN, {}, b"", loop.create_future(), now - 10.5)]
        assert transport._retry_delay(late, 1) is None
    finally:
        loop.close()


async def test_requests_stop_growing_at_the_byte_budget(world: World) -> None:
    interposer, transport = interposed(world, max_batch_bytes=4000)
    async with transport, transport._rest.client:
        env = Environment(transport, RUN, "env-0")
        await env.register()
        episodes = [await env.start_episode(f"e{i}", {"i": i}) for i in range(4)]
        sent_before = len(interposer.batches)
        big = "x" * 3000
        await asyncio.gather(*(e.boundary("seed", {"blob": big}) for e in episodes))
        assert interposer.batches[sent_before:] == [1, 1, 1, 1]


async def test_an_event_over_the_services_body_limit_is_refused_on_submit(world: World) -> None:
    # The service would close the connection on such a body unread (no reply to read).
    interposer, transport = interposed(world, max_event_bytes=1000)
    async with transport, transport._rest.client:
        env = Environment(transport, RUN, "env-0")
        await env.register()
        episode = await env.start_episode("e1", {"i": 1})
        sent = len(interposer.batches)
        with pytest.raises(PayloadTooLarge):
            await episode.boundary("seed", {"blob": "x" * 1000})
        assert len(interposer.batches) == sent and transport.in_flight == 0
        await episode.boundary("seed", {"blob": "x" * 100})


async def test_an_invalid_event_fails_alone(world: World) -> None:
    env = Environment(world.transport, RUN, "env-0")
    await env.register()
    first = await env.start_episode("e1", {"i": 1})
    second = await env.start_episode("e2", {"i": 2})
    bad, good = await asyncio.gather(
        first.boundary("not a stage name", {}),
        second.boundary("seed", {}),
        return_exceptions=True,
    )
    assert isinstance(bad, InvalidEvent) and bad.details["field"].endswith("stage")
    assert isinstance(good, Position)


# -- the lean HTTP/1.1 connection (a transport that opens its own) against a real server ------


class Relay:
    """A TCP relay in front of a real server that can cut its client connections (as a server
    closing idle keep-alive connections does), swallow the next reply after the server handled
    the request (a reply lost on the way), or reset a connection whose next request arrives
    ``idle_reset_s`` or more after its last reply, unanswered (a server closing an idle
    connection just as a request arrives on it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.posts = 0
        self.lose_reply = False
        self.idle_reset_s: float | None = None
        self.resets = 0
        self.clients: list[asyncio.StreamWriter] = []
        self.upstreams: list[asyncio.StreamWriter] = []
        self.handlers: list[asyncio.Task[None]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        for writer in self.clients:
            writer.close()
        self.clients.clear()

    async def stop(self) -> None:
        self.cut()
        for writer in self.upstreams:
            writer.close()
        await asyncio.gather(*self.handlers)
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.clients.append(writer)
        self.handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.upstreams.append(up_writer)
        loop = asyncio.get_running_loop()
        replied: list[float] = []  # when the last reply went out

        async def upstream() -> None:
            while data := await reader.read(65536):
                idle_reset_s = self.idle_reset_s
                if (
                    idle_reset_s is not None
                    and replied
                    and loop.time() - replied[0] >= idle_reset_s
                ):
                    self.resets += 1
                    writer.transport.abort()
                    break
                self.posts += data.count(b"POST /v1/runs/")
                up_writer.write(data)
            up_writer.close()

        pump = asyncio.create_task(upstream())
        try:
            while data := await up_reader.read(65536):
                if self.lose_reply:
                    self.lose_reply = False
                    break
                writer.write(data)
                await writer.drain()
                replied[:] = [loop.time()]
        except OSError:
            pass
        finally:
            writer.close()
            up_writer.close()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pump


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with running_server(tmp_path) as running:
        yield running


@pytest.mark.slow
async def test_the_lean_connection_reconnects_retries_and_reports_refusals(
    server: Server,
) -> None:
    relay = Relay(server.port)
    url = await relay.start()
    trainer = AsyncTrainerClient(server.url, token=TOKENS["trainer"])
    async with trainer, HttpTransport(url, token=TOKENS["participant"], backoff_s=0.01) as t:
        assert t._events is not None  # the lean connection, not httpx
        await trainer.create_run(RUN, partitions=2)
        await trainer.take_over(RUN)
        env = Environment(t, RUN, "env-0")
        policy = Policy(t, RUN, "policy-0")
        await env.register()
        await policy.register()
        episode = await env.start_episode("e1", {"prompt": "p"})
        await episode.boundary("seed", {"turn": 0})
        connections = relay.connections
        assert connections >= 1
        # The server closed the idle connection: the next append reconnects, no retry counted.
        relay.cut()
        await episode.boundary("invoke_agent", {"turn": 1})
        assert t.stats.retries == 0 and relay.connections == connections + 1
        # The reply is lost after the service appended: sent again, folded once.
        posts = relay.posts
        relay.lose_reply = True
        await policy.record_call(
            "e1", "c1", [1, 2], fingerprint=fingerprint([1]), context_digest="x"
        )
        assert relay.posts == posts + 2
        await episode.boundary("close_agent", {"turn": 2})
        # A refusal names its event; the rest of the request is appended.
        second = await env.start_episode("e2", {"prompt": "q"})
        bad, good = await asyncio.gather(
            episode.boundary("not a stage name", {}),
            second.boundary("seed", {}),
            return_exceptions=True,
        )
        assert isinstance(bad, InvalidEvent) and bad.details["field"].endswith("stage")
        assert isinstance(good, Position)
        checkpoint = await trainer.checkpoint(RUN)
        path = f"/v1/runs/{RUN}/episodes/e1/projection?checkpoint={checkpoint.checkpoint_id}"
        headers = {"Authorization": f"Bearer {TOKENS['participant']}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as client:
            projection = (await client.get(path)).raise_for_status().json()
        assert [row["call_id"] for row in projection["ledger"]] == ["c1"]
    await relay.stop()


@pytest.mark.slow
async def test_clients_let_idle_connections_go_before_the_service_closes_them(
    server: Server,
) -> None:
    """The service closes a connection idle for ``SERVICE_KEEPALIVE_S``; a request that arrives
    on it about then may be reset unanswered (here made certain: the relay resets a request
    arriving in the last half second before the service would close the connection itself).
    The trainer client, the SDK's REST calls and its event appends never reuse a connection
    that old: nothing is reset, nothing retried."""
    relay = Relay(server.port)
    url = await relay.start()
    trainer = AsyncTrainerClient(url, token=TOKENS["trainer"])
    async with trainer, HttpTransport(url, token=TOKENS["participant"], backoff_s=0.01) as t:
        assert t._events is not None  # the lean connection, not httpx
        await trainer.create_run(RUN, partitions=2)
        await trainer.take_over(RUN)
        env = Environment(t, RUN, "env-0")
        await env.register()
        episode = await env.start_episode("e1", {"prompt": "p"})
        await episode.boundary("seed", {"turn": 0})
        relay.idle_reset_s = SERVICE_KEEPALIVE_S - 0.5
        await asyncio.sleep(SERVICE_KEEPALIVE_S - 0.25)
        checkpoint = await trainer.checkpoint(RUN)
        await Environment(t, RUN, "env-1").register()
        await episode.boundary("invoke_agent", {"turn": 1})
        assert checkpoint.status == "committed"
        assert relay.resets == 0 and t.stats.retries == 0
    await relay.stop()


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b'5;x=1\r\n{"off\r\nB\r\nsets": [1]}\r\n0\r\nTrailer: y\r\n\r\n',
        b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"offsets": [1]}',
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 16\r\n"
        b'Connection: close\r\n\r\n{"offsets": [1]}',
    ],
)
async def test_the_lean_connection_reads_every_reply_framing(reply: bytes) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Http1Connection(f"http://127.0.0.1:{port}", {"Authorization": "Bearer t"})
    try:
        status, body = await connection.post("/v1/runs/r/events", b"{}", "application/x-ndjson")
        assert (status, orjson.loads(body)) == (200, {"offsets": [1]})
        assert connection._writer is None  # the server said it closes: not reused
    finally:
        connection.close()
        server.close()
        await server.wait_closed()


async def test_the_lean_connection_reports_a_dead_service_as_unavailable() -> None:
    connection = Http1Connection(f"http://127.0.0.1:{free_port()}", {})
    with pytest.raises(BackendUnavailable):
        await connection.post("/v1/runs/r/events", b"{}", "application/x-ndjson")


async def test_a_proxy_configured_for_the_service_leaves_event_posts_to_httpx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    assert direct_http_url("http://127.0.0.1:8750")
    assert not direct_http_url("unix:///tmp/socket")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert not direct_http_url("http://service.test:8750")
    proxied = HttpTransport("http://service.test:8750")
    assert proxied._events is None  # httpx, which honours the proxy
    monkeypatch.setenv("NO_PROXY", "service.test")
    assert direct_http_url("http://service.test:8750")
    direct = HttpTransport("http://service.test:8750")
    assert direct._events is not None
    for transport in (proxied, direct):
        await transport.stop()
