"""The crash suite's harness: the service and participants as real processes, each in its own
process group so that SIGKILL takes it down whole, on both deployments.

- ``Service``: ``python -m rolloutlog.api.cli serve`` on a free port over a data directory (and,
  distributed, a Kafka log and a PostgreSQL catalog); ``kill()`` SIGKILLs its group,
  ``start()`` again reopens the same data.
- ``Puppet``: a participant process (``tests/e2e/_puppet.py``) run one command at a time; it is
  idle between commands, which is where the tests kill it.
- ``catalog_writes_held``: SQL locks taken from the test process that make a restore's catalog
  commit wait, so that it is provably between its log records and its catalog commit when the
  service is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

from tests._services import ROOT, free_port
from tests.api.conftest import TOKENS

SERVICE_START_S = 60.0


@dataclass(frozen=True)
class Deployment:
    """Where a service keeps its log and catalog: ``embedded`` (SQLite files under ``data_dir``)
    or ``kafka`` (a Kafka topic prefix of its own and a PostgreSQL schema of its own)."""

    name: str
    data_dir: Path
    log_url: str | None = None
    catalog_url: str | None = None

    @property
    def distributed(self) -> bool:
        return self.log_url is not None

    @property
    def transport(self) -> str:
        """How participants append: straight to Kafka when there is Kafka, else over HTTP."""
        return "kafka" if self.distributed else "http"


def kafka_log_url(bootstrap: str) -> str:
    return f"kafka://{bootstrap}?topic_prefix=e{uuid.uuid4().hex[:10]}."


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything in its process group, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


class Service:
    def __init__(self, deployment: Deployment, workdir: Path) -> None:
        self.deployment = deployment
        self.tokens = workdir / "tokens.json"
        self.tokens.write_text(json.dumps(TOKENS))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = workdir / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        d = self.deployment
        args = [sys.executable, "-m", "rolloutlog.api.cli", "serve"]
        args += ["--data-dir", str(d.data_dir), "--port", str(self.port)]
        args += ["--tokens", str(self.tokens), "--log-level", "warning"]
        if d.log_url:
            args += ["--log", d.log_url]
        if d.catalog_url:
            args += ["--catalog", d.catalog_url]
        return args

    #: What ``start`` waits for: ``/readyz`` (ready), or ``/healthz`` (serving, maybe unready).
    wait_for = "/readyz"

    def _spawn(self, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
        with open(self.output, "ab") as out:
            return subprocess.Popen(
                self.command(),
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec_fn,
            )

    async def start(self) -> None:
        """Start (or restart, on the same data) and wait until ``wait_for`` answers 200."""
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        self.proc = self._spawn()
        deadline = time.monotonic() + SERVICE_START_S
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the service exited: {self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}{self.wait_for}")).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError(f"the service did not get {self.wait_for[1:]}: {self.tail()}")

    def kill(self) -> None:
        assert self.proc is not None
        kill_group(self.proc)

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-3000:] if self.output.exists() else ""


class PuppetError(AssertionError):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"{reply['error']} ({reply['code']}): {reply['message']}")
        self.reply = reply
        self.code = reply["code"]


class Puppet:
    """A participant process driven one command at a time (see ``tests/e2e/_puppet.py``)."""

    def __init__(self, service: Service, run: str, workdir: Path, name: str) -> None:
        self.service = service
        self.run = run
        self.stderr_path = workdir / f"puppet-{name}-{uuid.uuid4().hex[:6]}.err"
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e._puppet"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,
        )

    def _roundtrip(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(orjson.dumps(command) + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the puppet died: {self.stderr_path.read_text()[-3000:]}")
        reply: dict[str, Any] = orjson.loads(line)
        return reply

    async def send(self, command: dict[str, Any]) -> Any:
        reply = await asyncio.to_thread(self._roundtrip, command)
        if not reply["ok"]:
            raise PuppetError(reply)
        return reply["result"]

    async def open(self, deployment: Deployment) -> None:
        await self.send(
            {
                "op": "open",
                "transport": deployment.transport,
                "url": self.service.url,
                "token": TOKENS["participant"],
                "log_url": deployment.log_url,
            }
        )
        await self.send({"op": "restores", "url": self.service.url, "token": TOKENS["participant"]})

    async def participant(self, name: str, kind: str, pid: str, **options: Any) -> int:
        epoch: int = await self.send(
            {
                "op": "participant",
                "name": name,
                "kind": kind,
                "id": pid,
                "run": self.run,
                "options": options,
            }
        )
        return epoch

    async def call(
        self, target: str, method: str, *args: Any, as_: str | None = None, **kwargs: Any
    ) -> Any:
        command = {
            "op": "call",
            "target": target,
            "method": method,
            "args": list(args),
            "kwargs": kwargs,
        }
        if as_ is not None:
            command["as"] = as_
        return await self.send(command)

    def kill(self) -> None:
        kill_group(self.proc)
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()
        self._stderr.close()


@contextlib.asynccontextmanager
async def catalog_writes_held(
    deployment: Deployment, table: str, run: str
) -> AsyncIterator[CatalogHold]:
    """Hold the catalog so that the service's writes to ``table`` wait (PostgreSQL: an EXCLUSIVE
    lock on the table, which still lets readers read).

    SQLite has one write lock for the whole catalog, and a restore writes the catalog twice: it
    reserves its restore id, writes its ``attempt.started`` records to the log, then commits. So
    the run's embedded log is held first (the restore reserves its id, then waits on its records);
    ``wait_until_blocked`` takes the catalog once the reservation is visible and lets the records
    through, so that only the commit waits.
    """
    if deployment.catalog_url is None:
        catalog = deployment.data_dir / "catalog.sqlite3"
        sqlite = _SqliteRestoreHold(catalog, run)
        try:
            sqlite.hold_log(deployment.data_dir / "log" / f"{run}.sqlite3")
            yield CatalogHold(deployment, table, None, None, sqlite)
        finally:
            sqlite.release()
        return
    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(deployment.catalog_url)
    schema = url.query["search_path"]
    dsn = url.set(drivername="postgresql", query={}).render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": str(schema)})
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
        yield CatalogHold(deployment, table, dsn, str(schema))
        await transaction.rollback()
    finally:
        await conn.close()


class _SqliteRestoreHold:
    """The embedded deployment's hold: the log's write lock until the restore has reserved its
    id, then the catalog's."""

    def __init__(self, catalog: Path, run: str) -> None:
        self.catalog = catalog
        self.run = run
        self.reserved_before = self._last_restore_id()
        self._locks: list[sqlite3.Connection] = []

    def _last_restore_id(self) -> int:
        conn = sqlite3.connect(self.catalog, timeout=30)
        try:
            row = conn.execute(
                "SELECT last_restore_id FROM runs WHERE run = ?", (self.run,)
            ).fetchone()
            return int(row[0])
        finally:
            conn.close()

    def _lock(self, path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        conn.execute("BEGIN IMMEDIATE")  # SQLite's one write lock; readers go on (WAL)
        return conn

    def hold_log(self, path: Path) -> None:
        self._locks.append(self._lock(path))

    def reserved(self) -> bool:
        return self._last_restore_id() > self.reserved_before

    def swap_to_catalog(self) -> None:
        """Take the catalog, then let the log go (the restore's records are appended)."""
        log = self._locks.pop()
        self._locks.append(self._lock(self.catalog))
        log.execute("ROLLBACK")
        log.close()

    def release(self) -> None:
        while self._locks:
            conn = self._locks.pop()
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            conn.close()


@dataclass
class CatalogHold:
    deployment: Deployment
    table: str
    dsn: str | None
    schema: str | None
    sqlite: _SqliteRestoreHold | None = None

    async def wait_until_blocked(self, service: Service, run: str, log_records: int) -> None:
        """Until the service is provably waiting on the held catalog: on PostgreSQL a lock on
        the table is waited for; on SQLite the log holds ``log_records`` records (what the
        operation writes before its catalog commit) and the operation has not answered."""
        deadline = time.monotonic() + 30
        swapped = self.sqlite is None
        while time.monotonic() < deadline:
            if not swapped:
                assert self.sqlite is not None
                if self.sqlite.reserved():
                    self.sqlite.swap_to_catalog()
                    swapped = True
            elif await self._blocked(service, run, log_records):
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the service never reached the held catalog write")

    async def _blocked(self, service: Service, run: str, log_records: int) -> bool:
        if self.dsn is None:
            async with httpx.AsyncClient(timeout=5) as client:
                response = await client.get(
                    f"{service.url}/v1/runs/{run}/stats",
                    headers={"Authorization": f"Bearer {TOKENS['analyst']}"},
                )
            return bool(response.json()["events"]["log_records"] >= log_records)
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE NOT l.granted AND c.relname = $1 AND n.nspname = $2",
                self.table,
                self.schema,
            )
        finally:
            await conn.close()
        return bool(waiting)
