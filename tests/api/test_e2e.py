"""End to end through a real server: ``python -m rolloutlog.api.cli serve`` in a subprocess
(uvicorn, a free loopback port, tokens from a file), the trainer client, and a graceful shutdown
by SIGTERM that finishes in-flight appends. The CLI's commands: tests/api/test_cli.py."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutlog.trainer import TrainerClient, resume_run_sync
from tests import factories as f
from tests._services import ROOT, free_port
from tests.api.conftest import TOKENS, bearer, wire

pytestmark = pytest.mark.slow


#: How long a stop may take: a graceful stop waits up to the service's shutdown timeout (30 s by
#: default) for requests in flight, then closes the log and the catalog.
STOP_S = 60.0


class Server:
    def __init__(self, data_dir: Path, tokens: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.tokens = tokens
        self.extra = extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rolloutlog.api.cli",
                    "serve",
                    "--data-dir",
                    str(self.data_dir),
                    "--port",
                    str(self.port),
                    "--tokens",
                    str(self.tokens),
                    *self.extra,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server did not start: {self.log.read_text()}")

    def stop(self, timeout: float = STOP_S) -> int:
        """SIGTERM, then the exit code; a server still running after ``timeout`` prints its
        threads' stacks (SIGUSR2), is killed, and the failure shows the end of its log (which of
        the shutdown's stages it was in, and what each thread waited for)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR2)
            time.sleep(1)
            self.proc.kill()
            self.proc.wait()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-120:])
            raise AssertionError(
                f"the server did not stop within {timeout:g} s of SIGTERM; its log ends:\n{tail}"
            ) from None


@contextlib.contextmanager
def running_server(tmp_path: Path, *extra: str) -> Iterator[Server]:
    """A service in its own process on ``tmp_path``, with the test tokens and the ``extra``
    flags; stopped after."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    running = Server(tmp_path / "data", tokens, *extra)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with running_server(tmp_path) as running:
        yield running


def post(server: Server, path: str, role: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=bearer(role), timeout=30, **kw)


def test_large_states_stream_whole_through_a_real_server(server: Server) -> None:
    """States of 64 KB and more go out of a restore's stream as chunks of their own (views of
    their records, ``stream_ndjson_lines``): through uvicorn each line is the one the
    single-episode route gives, and each state the one appended."""
    assert post(server, "/v1/runs", "trainer", {"run": "big", "partitions": 2}).status_code == 201
    for pid, kind in (("env-0", "environment"), ("res-0", "resources")):
        registered = post(
            server, "/v1/runs/big/participants", "participant", {"id": pid, "kind": kind}
        )
        assert registered.status_code == 201, registered.text
    res = f.participant("resources", "res-0")
    states = {e: {"blob": e * (70_000 + 10_000 * i), "ünï": [i]} for i, e in enumerate("abcd")}
    events = []
    for episode, state in states.items():
        events += [
            f.started(episode),
            f.session_started(episode, "s1", "exported", who=res),
            f.session_state(episode, "s1", state, who=res),
            f.boundary(episode, "seed", {"small": episode, "big": "z" * 65_536}),
        ]
    assert post(server, "/v1/runs/big/events", "participant", wire(*events)).status_code == 200
    with TrainerClient(server.url, token=TOKENS["trainer"]) as trainer:
        trainer.take_over("big")
        checkpoint = trainer.checkpoint("big")
        restored = trainer.restore("big", checkpoint_id=checkpoint.checkpoint_id)
    url = f"{server.url}/v1/runs/big/restores/{restored.restore_id}/projections"
    body = httpx.get(url, headers=bearer("participant"), timeout=30).content
    lines = body.splitlines()
    assert len(lines) == 4 and body.endswith(b"\n")
    for line in lines:
        projection = orjson.loads(line)
        episode = projection["episode"]
        assert projection["sessions"]["s1"]["state"] == states[episode]
        assert projection["boundaries"]["environment"]["state"]["big"] == "z" * 65_536
        single = httpx.get(
            f"{server.url}/v1/runs/big/episodes/{episode}/projection",
            params={"restore": restored.restore_id},
            headers=bearer("participant"),
            timeout=30,
        )
        assert single.content == line


def test_the_whole_path_through_a_real_server(server: Server) -> None:
    assert post(server, "/v1/runs", "trainer", {"run": "e2e", "partitions": 4}).status_code == 201
    registered = post(
        server, "/v1/runs/e2e/participants", "participant", {"id": "env-0", "kind": "environment"}
    )
    assert registered.json()["epoch"] == 1
    events = wire(
        f.started("a"),
        f.boundary("a", "seed", {"turn": 1}),
        f.started("b"),
        f.boundary("b", "seed", {"turn": 1}),
    )
    appended = post(server, "/v1/runs/e2e/events", "participant", events)
    assert appended.status_code == 200, appended.text
    assert len(appended.json()["offsets"]) == 4
    ndjson = b"\n".join(orjson.dumps(e) for e in wire(f.boundary("a", "invoke_agent", {"turn": 2})))
    streamed = httpx.post(
        f"{server.url}/v1/runs/e2e/events",
        content=ndjson,
        headers={**bearer("participant"), "Content-Type": "application/x-ndjson"},
    )
    assert streamed.status_code == 200, streamed.text

    with TrainerClient(server.url, token=TOKENS["trainer"]) as trainer:
        epoch = trainer.take_over("e2e")
        checkpoint = trainer.checkpoint("e2e")
        assert checkpoint.status == "committed"
        assert checkpoint.counts == {"continue": 2, "restart": 0, "finished": 0}
        manifest = list(trainer.manifest("e2e", checkpoint.checkpoint_id))
        assert {m["episode"] for m in manifest} == {"a", "b"}
        plan = resume_run_sync(trainer, "e2e", exclude=["b"])
        assert plan.controller_epoch == epoch + 1
        assert [(d.episode, d.capture_key, d.action) for d in plan.dispatch] == [
            ("a", "a-a1", "continue")
        ]
        assert plan.excluded == ("b",)

    with TrainerClient(server.url, token=TOKENS["participant"]) as participant:
        projection = participant.projection("e2e", "a", restore=plan.restore_id)
        assert projection["capture_key"] == "a-a1"
        assert projection["boundaries"]["environment"]["state"] == {"turn": 2}
        bulk = list(participant.projections("e2e", plan.restore_id or 0, kind="environment"))
        assert [p["episode"] for p in bulk] == ["a"]

    fenced = post(server, "/v1/runs/e2e/events", "participant", wire(f.boundary("a", "old")))
    assert (fenced.status_code, fenced.json()["error"]["code"]) == (409, "attempt_fenced")
    assert "rolloutlog_appends_total 2" in httpx.get(f"{server.url}/metrics").text

    assert server.stop() == 0
    log = server.log.read_text()
    assert '"message":"service stopped"' in log
    assert all(line.startswith("{") for line in log.splitlines() if line.strip())


def test_sigusr2_prints_every_threads_stack_and_the_service_goes_on(server: Server) -> None:
    """What an operator (or a stop that does not end, ``Server.stop``) asks of a running service:
    SIGUSR2 prints each thread's stack to its stderr, and it keeps serving, then stops as ever."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while "most recent call first" not in server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "no stacks printed"
        time.sleep(0.1)
    assert 'File "' in server.log.read_text(errors="replace")
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    assert server.stop() == 0


def test_sigterm_finishes_in_flight_appends_and_loses_none(server: Server) -> None:
    post(server, "/v1/runs", "trainer", {"run": "drain", "partitions": 4})
    post(
        server, "/v1/runs/drain/participants", "participant", {"id": "env-0", "kind": "environment"}
    )
    batches = [
        orjson.dumps(wire(*(f.boundary(f"e{i}", "s", {"blob": "x" * 2000}) for i in range(200))))
        for _ in range(40)
    ]
    acknowledged = 0
    outcomes: list[str] = []
    first_done = threading.Event()

    def writer() -> None:
        nonlocal acknowledged
        with httpx.Client(timeout=30) as client:
            for body in batches:
                try:
                    response = client.post(
                        f"{server.url}/v1/runs/drain/events",
                        content=body,
                        headers={**bearer("participant"), "Content-Type": "application/json"},
                    )
                except httpx.HTTPError as e:
                    outcomes.append(type(e).__name__)  # refused: the server stopped listening
                    first_done.set()
                    return
                outcomes.append(str(response.status_code))
                if response.status_code == 200:
                    acknowledged += len(response.json()["offsets"])
                first_done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert first_done.wait(30)
    assert server.stop() == 0
    thread.join(30)
    assert outcomes[0] == "200"
    # Every reply that arrived is whole: acknowledged, or refused while draining.
    assert set(outcomes) <= {"200", "503", "ConnectError", "RemoteProtocolError", "ReadError"}
    assert acknowledged >= 200

    server.start()  # the same data directory: every acknowledged event is in the log
    stats = httpx.get(f"{server.url}/v1/runs/drain/stats", headers=bearer("analyst")).json()
    assert stats["events"]["log_records"] >= acknowledged
