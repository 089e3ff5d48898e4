"""A real ``rolloutlog serve`` process (embedded log, SQLite catalog, no tokens, loopback) for the
API slice's fault tests, with raw-socket helpers for clients that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests._services import free_port

ROOT = Path(__file__).resolve().parents[2]
START_S = 60.0


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    output: Path

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-3000:]

    def alive(self) -> bool:
        return self.proc.poll() is None


def with_limits(limits: Mapping[int, tuple[int, int]]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets these resource limits (``{RLIMIT_X: (soft, hard)}``) in the
    child before it runs."""

    def apply() -> None:
        for which, (soft, hard) in limits.items():
            resource.setrlimit(which, (soft, hard))

    return apply


def _spawn(
    args: list[str], output: Path, preexec_fn: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    with open(output, "ab") as out:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


@contextlib.asynccontextmanager
async def serve(
    workdir: Path, *flags: str, limits: Mapping[int, tuple[int, int]] | None = None
) -> AsyncIterator[Served]:
    """Start ``rolloutlog serve`` on a free port (under ``limits``, see ``with_limits``) and wait
    for ``/readyz``; stop it (by its PID) afterwards."""
    port = free_port()
    output = workdir / f"serve-{port}.log"
    args = [sys.executable, "-m", "rolloutlog.api.cli", "serve", "--port", str(port)]
    args += ["--data-dir", str(workdir / "data"), "--log-level", "warning", *flags]
    proc = _spawn(args, output, with_limits(limits) if limits else None)
    served = Served(f"http://127.0.0.1:{port}", port, proc, output)
    try:
        deadline = time.monotonic() + START_S
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                assert proc.poll() is None, f"the service exited: {served.tail()}"
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{served.url}/readyz")).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"not ready: {served.tail()}"
                await asyncio.sleep(0.05)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def envelope(
    episode: str,
    seq: int,
    *,
    pid: str = "env-0",
    epoch: int = 1,
    attempt: int = 0,
    type_: str = "step.boundary",
    stage: str = "seed",
) -> dict[str, Any]:
    """An environment event (a boundary unless ``type_`` says otherwise)."""
    data: dict[str, Any]
    if type_ == "episode.started":
        data = {"task": {"prompt": episode}, "task_digest": "d" * 64}
    elif type_ == "step.started":
        data = {"owner": "environment", "stage": stage, "mode": "replay"}
    else:
        data = {"owner": "environment", "stage": stage, "state": {"stage": stage}}
    return {
        "v": 1,
        "type": type_,
        "episode": episode,
        "attempt": attempt,
        "participant": {"id": pid, "kind": "environment", "epoch": epoch},
        "seq": seq,
        "ts": 1.0,
        "data": data,
    }


async def create_run(client: httpx.AsyncClient, run: str, partitions: int = 2) -> None:
    response = await client.post("/v1/runs", json={"run": run, "partitions": partitions})
    assert response.status_code == 201, response.text


async def register(client: httpx.AsyncClient, run: str, pid: str = "env-0") -> int:
    response = await client.post(
        f"/v1/runs/{run}/participants", json={"id": pid, "kind": "environment"}
    )
    assert response.status_code == 201, response.text
    epoch: int = response.json()["epoch"]
    return epoch


async def take_over(client: httpx.AsyncClient, run: str) -> int:
    response = await client.post(f"/v1/runs/{run}/controller", json={})
    assert response.status_code == 200, response.text
    epoch: int = response.json()["controller_epoch"]
    return epoch


async def append(
    client: httpx.AsyncClient, run: str, events: Sequence[dict[str, Any]]
) -> httpx.Response:
    return await client.post(f"/v1/runs/{run}/events", json=list(events))


async def append_when_served(
    client: httpx.AsyncClient,
    served: Served,
    run: str,
    events: Sequence[dict[str, Any]],
    since: float,
    within_s: float,
) -> float:
    """Append, retrying each ``503`` every 0.1 s (as the SDK backs off) until it is served,
    which must be within ``within_s`` of ``since`` (a ``time.monotonic()``); the seconds it
    took from ``since``."""
    while True:
        response = await append(client, run, events)
        if response.status_code == 200:
            return time.monotonic() - since
        assert response.status_code == 503, response.text
        assert time.monotonic() - since < within_s, served.tail()
        await asyncio.sleep(0.1)


async def trickle(
    port: int,
    head: bytes,
    every_s: float,
    stop: asyncio.Event,
    replies: list[tuple[bytes, float]],
) -> None:
    """A slow client, as slow-loris tools are: ``head`` (a request's headers), then a byte every
    ``every_s`` until the service answers and closes; then the same on a new connection, until
    ``stop``. Each answer and how long its connection was held go to ``replies``."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(every_s)
            continue
        opened = time.monotonic()
        reply = b""
        try:
            writer.write(head)
            while not stop.is_set():
                try:
                    data = await asyncio.wait_for(reader.read(65536), timeout=every_s)
                except TimeoutError:
                    if reply:  # answered, not closed
                        break
                    writer.write(b" ")  # before the answer only: after it, a reset loses it
                    continue
                if not data:
                    break
                reply += data
        except OSError:
            pass
        finally:
            writer.close()
            if reply:
                replies.append((reply, time.monotonic() - opened))


def raw_connection(port: int, first_bytes: bytes) -> socket.socket:
    """A connection that has sent ``first_bytes`` and then goes quiet."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(first_bytes)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``sock`` within ``seconds``, and what it sent before."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received
