"""Helpers of the supervise slice's fault tests: bad records, a service that may start unready,
a Tansu broker whose PID the test holds (to SIGSTOP it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from rolloutlog.log import partition_for
from tests._services import free_port, port_open, tansu_binary
from tests.e2e._harness import Service

#: Records that are not rolloutlog envelopes, or whose metadata has the wrong types, for an
#: episode ``e`` of the run (a ``{episode}`` in them names it).
BAD_VALUES = (
    b"\xff\xfenot json at all",
    b'{"v": 1, "episode": "{episode}", "data": {}}',  # no type
    # A seq that is a string: folded, it would make every later event of env-0 raise.
    b'{"v":1,"type":"step.boundary","episode":"{episode}","attempt":0,"step":null,'
    b'"participant":{"id":"env-0","kind":"environment","epoch":1},"seq":"x","ts":1.0,'
    b'"data":{"owner":"environment","stage":"bad","next":null}}',
)


def bad_records(episode: str) -> list[bytes]:
    return [value.replace(b"{episode}", episode.encode()) for value in BAD_VALUES]


def partition_of(episode: str, partitions: int) -> int:
    return partition_for(episode, partitions)


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    """Poll ``check`` until it holds (a generous deadline for "recovers within N s")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} did not hold within {timeout_s} s")


class UnreadyService(Service):
    """A real ``rolloutlog serve`` whose start waits for ``/healthz`` only: with a broken run it
    serves, but ``/readyz`` says 503."""

    wait_for = "/healthz"


@dataclass
class Tansu:
    """A Tansu broker of the test's own (memory storage), so the test may stop it by PID."""

    port: int
    proc: subprocess.Popen[bytes]

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def own_tansu(port: int | None = None) -> Iterator[Tansu]:
    binary = tansu_binary()
    port = port or free_port()
    address = f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(
            [
                *(binary, "broker", "--listener-url", address),
                *("--advertised-listener-url", address, "--storage-engine", "memory://tansu/"),
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 20
            while not port_open("127.0.0.1", port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    output.seek(0)
                    raise RuntimeError(f"tansu did not start: {output.read()[-2000:]!r}")
                time.sleep(0.05)
            yield Tansu(port, proc)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)


def envelope(episode: str, kind: str, seq: int, data: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "type": kind,
        "episode": episode,
        "attempt": 0,
        "step": None,
        "participant": {"id": "env-0", "kind": "environment", "epoch": kw.get("epoch", 1)},
        "seq": seq,
        "ts": time.time(),
        "data": data,
    }


def json_lines(*values: dict[str, Any]) -> bytes:
    return b"\n".join(orjson.dumps(value) for value in values)
