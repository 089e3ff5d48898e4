"""No token appears in anything the service or its clients write: a real ``rolloutlog serve``
(``--access-log``, ``--log-level debug``, tokens from a TOML file, a variable and a ``*_FILE``)
taken through faults that log — missing, wrong, malformed, mis-scoped and wrong-role tokens, a
request line the HTTP parser refuses, bad envelopes and an oversized body, a participant
SIGKILLed mid-run then fenced, the service SIGKILLed and restarted over bad records in its
log, CLI errors, start-up failures over bad token configuration — and then every line written
(the service's output, the participant's, the CLI's, every HTTP reply's headers and body,
``/readyz`` and ``/metrics``) is searched for every token and for each token's halves."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rolloutlog.api._tokens import Role
from rolloutlog.log import Record, open_log
from tests import factories as f
from tests._services import ROOT
from tests.api.conftest import wire
from tests.api.test_auth import scoped_env, scoped_token_file
from tests.api.test_e2e import Server
from tests.faults._supervise import bad_records

pytestmark = pytest.mark.slow

RUN = "exp-leaks"  # in the scoped tokens' scope (exp-*)
OTHER = "other-leaks"


def _secret(name: str) -> str:
    """A token nothing else could contain, not even half of it (hex, 32 characters)."""
    return hashlib.sha256(f"rolloutlog-leak-test {name}".encode()).hexdigest()[:32]


#: The service's tokens per role, unscoped and scoped (as tests/api/test_auth.py configures them).
TOKENS = {role.value: _secret(role.value) for role in Role}
SCOPED = {role.value: _secret(f"{role.value} scoped") for role in Role}
#: A token only a ``*_FILE`` variable holds (a Docker secret's file).
FROM_FILE = _secret("from a file")
#: Every secret the service was given.
SECRETS = (*TOKENS.values(), *SCOPED.values(), FROM_FILE)
#: Seen in the access log: proves the search reads the lines the requests wrote.
MARKER = "marker-of-this-request-7f3a"

PARTICIPANT = """
import asyncio, sys
from rolloutlog.participants import Environment, HttpTransport

async def main() -> None:
    async with HttpTransport(sys.argv[1], deadline_s=30) as transport:  # ROLLOUTLOG_TOKEN
        env = Environment(transport, sys.argv[2], "env-0")
        await env.register()
        for i in range(1_000_000):
            episode = await env.start_episode(f"k{i}", {"prompt": str(i)})
            await episode.boundary("seed", {"turn": i})
            print("appended", i, flush=True)

asyncio.run(main())
"""


def _pieces(secret: str) -> list[str]:
    """The secret and its halves (a token cut in two by a log formatter is still a leak)."""
    half = len(secret) // 2
    return [secret, secret[:half], secret[half:]]


class Written:
    """Everything the run wrote that a reader could see, by where it came from."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def add(self, where: str, text: str) -> None:
        self.texts.append((where, text))

    def reply(self, where: str, reply: httpx.Response) -> httpx.Response:
        headers = "\n".join(f"{k}: {v}" for k, v in reply.headers.items())
        self.add(f"{where}: HTTP {reply.status_code}", f"{headers}\n{reply.text}")
        return reply

    def leaks(self) -> list[str]:
        found = []
        for where, text in self.texts:
            for secret in SECRETS:
                found += [f"{where}: {piece!r}" for piece in _pieces(secret) if piece in text]
        return found


@pytest.fixture
def environ(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The service's environment: a scoped admin token in a variable, an analyst token in the
    file a ``*_FILE`` variable names."""
    secret_file = tmp_path / "analyst-token"
    secret_file.write_text(FROM_FILE + "\n")
    extra = {**scoped_env(SCOPED), "ROLLOUTLOG_TOKEN_ANALYST_FILE": str(secret_file)}
    with pytest.MonkeyPatch.context() as env:
        for name, value in extra.items():
            env.setenv(name, value)
        yield {**os.environ}


def _bad_token_requests(client: httpx.Client, written: Written) -> None:
    url = f"/v1/runs/{RUN}"
    for secret in SECRETS:
        for header in (
            f"Bearer {secret}x",  # one character more
            f"Bearer {secret[:-1]}",  # one less
            f"Basic {secret}",  # the wrong scheme
            f"Bearer  {secret} trailing",
            f"bearer {secret.upper()}",
        ):
            written.reply(header.split()[0], client.get(url, headers={"Authorization": header}))
    for role in ("participant", "trainer", "analyst"):
        for other, token in TOKENS.items():
            if other == role or other == "admin":
                continue
            # each real token on a route of another role: 403 naming roles, never the token
            route = {"participant": f"{url}/participants", "trainer": f"{url}/controller"}
            path = route.get(role, f"{url}/episodes")
            method = "GET" if role == "analyst" else "POST"
            headers = {"Authorization": f"Bearer {token}"}
            written.reply(f"{other} on {role}", client.request(method, path, headers=headers))
    for role in Role:  # scoped tokens out of their scope, on the path and in a body
        headers = {"Authorization": f"Bearer {SCOPED[role.value]}"}
        written.reply("out of scope", client.get(f"/v1/runs/{OTHER}", headers=headers))
        written.reply(
            "out of scope",
            client.post("/v1/runs", json={"run": "elsewhere"}, headers=headers),
        )
    written.reply(
        "marker",
        client.get(f"/v1/runs/{MARKER}", headers={"Authorization": f"Bearer {SECRETS[0]}x"}),
    )


def _malformed_request_line(server: Server, written: Written) -> None:
    """A request the HTTP parser refuses, a token in its headers (uvicorn logs the refusal)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            f"GET /v1/runs HTTP/1.1 extra\r\nAuthorization: Bearer {TOKENS['admin']}\r\n"
            f"Host: x\r\n\r\n".encode()
        )
        written.add("malformed request's reply", sock.recv(65536).decode(errors="replace"))


def _bad_envelopes(client: httpx.Client, written: Written, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    events = f"/v1/runs/{RUN}/events"
    written.reply("not JSON", client.post(events, content=b"{not json", headers=headers))
    written.reply("no type", client.post(events, json=[{"v": 1, "episode": "x"}], headers=headers))
    unregistered = wire(f.started("u"))
    unregistered[0]["participant"]["id"] = "nobody"
    written.reply("unregistered", client.post(events, json=unregistered, headers=headers))
    big = b"[" + b" " * (2 * 1024 * 1024) + b"]"
    written.reply("too large", client.post(events, content=big, headers=headers))


def _kill_a_participant(server: Server, tmp_path: Path, written: Written) -> None:
    """A participant process appending, SIGKILLed; its successor's registration fences it."""
    script = tmp_path / "participant.py"
    script.write_text(PARTICIPANT)
    output = tmp_path / "participant.out"
    env = {**os.environ, "ROLLOUTLOG_TOKEN": SCOPED["participant"], "PYTHONPATH": str(ROOT)}
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), server.url, RUN],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while output.read_text().count("appended") < 5:
            assert proc.poll() is None, output.read_text()
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    written.add("killed participant's output", output.read_text(errors="replace"))


def _run_cli(written: Written, server: Server, env: dict[str, str], *args: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "rolloutlog.api.cli", *args],
        cwd=ROOT,
        env={**env, "ROLLOUTLOG_URL": server.url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    written.add(f"rolloutlog {' '.join(args)}", done.stdout + done.stderr)
    return done.returncode


def _serve_refuses(written: Written, tmp_path: Path, env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rolloutlog.api.cli", "serve", "--data-dir", str(tmp_path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    written.add(f"serve {' '.join(args)}", done.stdout + done.stderr)


async def _append_bad_records(data_dir: Path) -> None:
    """Bad records straight into the embedded log of the killed service."""
    log = open_log(f"embedded://{data_dir}")
    async with log:
        records = [Record(0, b"bad", value) for value in bad_records("bad")]
        records += [Record(1, b"bad", value) for value in bad_records("bad")]
        await log.append_records(RUN, records)


def test_no_token_in_any_line_written(tmp_path: Path, environ: dict[str, str]) -> None:
    written = Written()
    tokens = scoped_token_file(tmp_path / "tokens.toml", TOKENS, SCOPED)
    flags = ("--access-log", "--log-level", "debug", "--max-body-mb", "1", "--metrics-auth")
    server = Server(tmp_path / "data", tokens, *flags)
    server.start()
    admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for run in (RUN, OTHER):
                made = client.post("/v1/runs", json={"run": run, "partitions": 2}, headers=admin)
                assert written.reply("create", made).status_code == 201
            _bad_token_requests(client, written)
            _malformed_request_line(server, written)
            _kill_a_participant(server, tmp_path, written)
            # The killed participant's successor: a new epoch, the old one's events fenced.
            participant = {"Authorization": f"Bearer {TOKENS['participant']}"}
            again = client.post(
                f"/v1/runs/{RUN}/participants",
                json={"id": "env-0", "kind": "environment"},
                headers=participant,
            )
            assert written.reply("re-register", again).json()["epoch"] == 2
            fenced = client.post(
                f"/v1/runs/{RUN}/events",
                json=wire(f.boundary("k0", "late", {"turn": 99})),
                headers=participant,
            )
            assert written.reply("fenced", fenced).json()["error"]["code"] == "participant_fenced"
            _bad_envelopes(client, written, SCOPED["participant"])
            for path in ("/readyz", "/metrics"):
                written.reply(path, client.get(path))
                written.reply(path, client.get(path, headers=admin))
        # The service SIGKILLed; bad records in its log; restarted over them.
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        asyncio.run(_append_bad_records(tmp_path / "data"))
        with pytest.MonkeyPatch.context() as env:
            env.setattr(server, "log", server.log.with_suffix(".restarted.log"))
            server.start()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            deadline = time.monotonic() + 60
            while True:
                quarantine = client.get(f"/v1/runs/{RUN}/quarantine", headers=admin)
                if len(written.reply("quarantine", quarantine).json()["records"]) >= 6:
                    break
                assert time.monotonic() < deadline, quarantine.text
                time.sleep(0.2)
            written.reply("/readyz", client.get("/readyz", headers=admin))
        cli_env = {k: v for k, v in environ.items() if not k.startswith("ROLLOUTLOG_TOKEN")}
        assert _run_cli(written, server, cli_env, "runs", "--token", SECRETS[1] + "x") == 1
        scoped = {**cli_env, "ROLLOUTLOG_TOKEN": SCOPED["analyst"]}
        assert _run_cli(written, server, scoped, "runs", "show", OTHER) == 1
        assert _run_cli(written, server, scoped, "checkpoint", RUN) == 1
        assert _run_cli(written, server, scoped, "quarantine", RUN) == 0
    finally:
        assert server.stop() == 0
    # Start-up failures over bad token configuration.
    short = tmp_path / "short.toml"
    short.write_text(f'trainer = "{TOKENS["trainer"][:10]}"\n')
    _serve_refuses(written, tmp_path / "s1", environ, "--tokens", str(short))
    broken = tmp_path / "broken.toml"
    broken.write_text(f'trainer = "{TOKENS["trainer"]}\n')  # an unterminated string
    _serve_refuses(written, tmp_path / "s2", environ, "--tokens", str(broken))
    badscope = {**environ, "ROLLOUTLOG_TOKEN_TRAINER": f"{TOKENS['trainer']}:exp/*"}
    _serve_refuses(written, tmp_path / "s3", badscope, "--tokens", str(tokens))
    for log in sorted(tmp_path.glob("serve-*.log")):
        written.add(log.name, log.read_text(errors="replace"))
    service_output = "\n".join(text for where, text in written.texts if where.startswith("serve-"))
    # The search read what the faults wrote: refusals, the parser's, quarantine, the marker.
    assert MARKER in service_output
    for seen in (
        '"status":401',
        '"status":403',
        "Invalid HTTP request",
        ": quarantined the record",
    ):
        assert seen in service_output, seen
    assert not written.leaks(), written.leaks()
