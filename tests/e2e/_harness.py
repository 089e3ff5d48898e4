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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

from rolloutlog.wire import CLIENT_KEEPALIVE_S
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


# -- replicas -------------------------------------------------------------------------

#: The replicas' lease (``--lease-s``): short, so that failover takes seconds in the tests, and
#: not shorter (2 s flapped on this 2-core machine under a 4,000-rollout restore).
REPLICA_LEASE_S = 3.0


def _asyncpg_target(catalog_url: str) -> tuple[str, str]:
    """(asyncpg DSN, schema) of a test catalog URL (``…?search_path=SCHEMA``)."""
    from sqlalchemy.engine import make_url

    url = make_url(catalog_url)
    schema = str(url.query["search_path"])
    return url.set(drivername="postgresql", query={}).render_as_string(hide_password=False), schema


class Replica(Service):
    """One replica of a replicated service: ``serve --replica-id ID --lease-s S`` on the
    deployment's Kafka log and PostgreSQL catalog, with a data directory of its own; ``pause``
    and ``resume`` SIGSTOP and SIGCONT its process group (a zombie while stopped).
    ``tokens=False``: no tokens (loopback only), as the simulated Gym's clients expect."""

    def __init__(
        self,
        deployment: Deployment,
        workdir: Path,
        replica_id: str,
        lease_s: float | None,
        tokens: bool = True,
    ) -> None:
        assert deployment.distributed, "replicas share a Kafka log and a PostgreSQL catalog"
        own = Deployment(
            deployment.name,
            deployment.data_dir / replica_id,
            deployment.log_url,
            deployment.catalog_url,
        )
        super().__init__(own, workdir)
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.with_tokens = tokens
        self.output = workdir / f"serve-{replica_id}.log"

    def command(self) -> list[str]:
        args = [*super().command(), "--replica-id", self.replica_id]
        if not self.with_tokens:
            at = args.index("--tokens")
            del args[at : at + 2]
        if self.lease_s is not None:
            args += ["--lease-s", str(self.lease_s)]
        return args

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pause(self) -> None:
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def cpu_s(self) -> float:
        """User + system CPU seconds the replica's process has used (``/proc/PID/stat``)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Replicas:
    """``count`` replicas ``r1``…``rN`` of one service (one Kafka topic prefix, one PostgreSQL
    schema); ``catalog`` reads what they wrote there."""

    def __init__(
        self,
        deployment: Deployment,
        workdir: Path,
        count: int,
        lease_s: float | None = REPLICA_LEASE_S,
        tokens: bool = True,
    ) -> None:
        self.deployment = deployment
        self.members = [
            Replica(deployment, workdir, f"r{i}", lease_s, tokens) for i in range(1, count + 1)
        ]
        assert deployment.catalog_url is not None
        self.catalog = CatalogView(deployment.catalog_url)

    def __getitem__(self, replica_id: str) -> Replica:
        return next(r for r in self.members if r.replica_id == replica_id)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.members)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.members]

    async def start(self) -> None:
        """Start every replica: the first alone (it migrates the catalog), the others at once."""
        await self.members[0].start()
        await asyncio.gather(*(replica.start() for replica in self.members[1:]))

    def stop(self) -> None:
        for replica in self.members:
            if replica.proc is not None and replica.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.resume()  # a stopped process cannot act on SIGTERM
            replica.stop()

    def tails(self) -> str:
        """Every replica's log tail (for a failed assertion's message)."""
        return "\n".join(f"--- {r.replica_id}:\n{r.tail()}" for r in self.members)


def _client_ports(pid: int) -> set[int]:
    """The local TCP ports of process ``pid``'s sockets (``/proc/PID/fd`` and
    ``/proc/net/tcp{,6}``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class CatalogView:
    """Reads of the replicas' shared catalog (the test's own connection, never the service's)."""

    def __init__(self, catalog_url: str) -> None:
        self.dsn, self.schema = _asyncpg_target(catalog_url)

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        import asyncpg

        conn = await asyncpg.connect(self.dsn, server_settings={"search_path": self.schema})
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def waiting_on_lock(self, pid: int) -> bool:
        """Whether a catalog connection of process ``pid`` waits for a lock (its backend, found
        by the client port of the process's sockets)."""
        ports = _client_ports(pid)
        rows = await self.fetch(
            "SELECT count(*) AS n FROM pg_stat_activity "
            "WHERE client_port = ANY($1::int[]) AND wait_event_type = 'Lock'",
            sorted(ports),
        )
        return bool(rows[0]["n"])

    async def leases(self, run: str) -> dict[int, tuple[str | None, int]]:
        """Each partition's (owner or None when released, generation)."""
        rows = await self.fetch(
            "SELECT partition, replica_id, generation FROM partition_leases WHERE run = $1", run
        )
        return {row["partition"]: (row["replica_id"], row["generation"]) for row in rows}

    async def wait_owned(
        self, run: str, partitions: int, by: set[str], timeout_s: float = 30.0
    ) -> dict[int, tuple[str | None, int]]:
        """Until every partition is owned by a replica in ``by`` (and each of them owns some
        when there are partitions enough); returns the leases."""
        deadline = time.monotonic() + timeout_s
        while True:
            leases = await self.leases(run)
            owners = {owner for owner, _ in leases.values()}
            if (
                len(leases) == partitions
                and owners <= by
                and (partitions < len(by) or owners == by)
            ):
                return leases
            if time.monotonic() > deadline:
                raise AssertionError(f"partitions of {run!r} not owned by {sorted(by)}: {leases}")
            await asyncio.sleep(0.05)

    async def checkpoint(self, run: str, checkpoint_id: int) -> dict[str, Any]:
        """A checkpoint's row, with its parts (partition -> (replica, generation)) and the
        partitions its own manifest parts cover."""
        rows = await self.fetch(
            "SELECT status, reason FROM checkpoints WHERE run = $1 AND checkpoint_id = $2",
            run,
            checkpoint_id,
        )
        assert rows, f"no checkpoint {checkpoint_id} of {run!r}"
        parts = await self.fetch(
            "SELECT partition, replica_id, generation FROM checkpoint_parts "
            "WHERE run = $1 AND checkpoint_id = $2",
            run,
            checkpoint_id,
        )
        manifest = await self.fetch(
            "SELECT cut_partition FROM manifest_parts WHERE run = $1 AND checkpoint_id = $2",
            run,
            checkpoint_id,
        )
        offsets = await self.fetch(
            "SELECT partition FROM checkpoint_offsets WHERE run = $1 AND checkpoint_id = $2",
            run,
            checkpoint_id,
        )
        return {
            "status": rows[0]["status"],
            "reason": rows[0]["reason"],
            "parts": {p["partition"]: (p["replica_id"], p["generation"]) for p in parts},
            "manifest_partitions": {m["cut_partition"] for m in manifest},
            "offset_partitions": {o["partition"] for o in offsets},
        }

    async def pending_checkpoint(self, run: str, timeout_s: float = 30.0) -> int:
        """Until the run has a pending checkpoint; its id."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = await self.fetch(
                "SELECT checkpoint_id FROM checkpoints WHERE run = $1 AND status = 'pending'", run
            )
            if rows:
                return int(rows[0]["checkpoint_id"])
            if time.monotonic() > deadline:
                raise AssertionError(f"no pending checkpoint of {run!r}")
            await asyncio.sleep(0.02)

    async def wait_checkpoint_ended(
        self, run: str, checkpoint_id: int, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            checkpoint = await self.checkpoint(run, checkpoint_id)
            if checkpoint["status"] != "pending":
                return checkpoint
            if time.monotonic() > deadline:
                raise AssertionError(f"checkpoint {checkpoint_id} still pending: {checkpoint}")
            await asyncio.sleep(0.05)

    async def restore_requests(self, run: str) -> dict[int, dict[str, Any]]:
        rows = await self.fetch(
            "SELECT restore_id, status, requested_by, reason FROM restore_requests WHERE run = $1",
            run,
        )
        return {row["restore_id"]: dict(row) for row in rows}

    async def restore_parts(self, run: str, restore_id: int) -> dict[int, tuple[str, int]]:
        rows = await self.fetch(
            "SELECT partition, replica_id, generation FROM restore_parts "
            "WHERE run = $1 AND restore_id = $2",
            run,
            restore_id,
        )
        return {row["partition"]: (row["replica_id"], row["generation"]) for row in rows}


@dataclass
class Acked:
    """An event whose append a replica acknowledged, and where it landed."""

    event: dict[str, Any]
    partition: int
    offset: int
    via: str


class Appends:
    """Events appended over HTTP to whichever replica a test names; every acknowledged event is
    kept (``acked``) and every refusal counted (``refused``), for ``check_log``."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.acked: list[Acked] = []
        self.refused: list[tuple[str, int, str]] = []
        # Idle connections expire before the service closes them (``wire.CLIENT_KEEPALIVE_S``):
        # an append between checkpoints that wait seconds would otherwise race that close.
        self.client = httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
        )

    async def post(self, replica: Service, events: list[dict[str, Any]]) -> bool:
        """Append ``events`` (all or none) through ``replica``; True when acknowledged."""
        body = b"".join(orjson.dumps(event) + b"\n" for event in events)
        try:
            response = await self.client.post(
                f"{replica.url}/v1/runs/{self.run}/events",
                content=body,
                headers={
                    "Authorization": f"Bearer {TOKENS['participant']}",
                    "Content-Type": "application/x-ndjson",
                },
            )
        except httpx.TransportError as e:
            self.refused.append((replica.url, 0, repr(e)))  # no answer: not acknowledged
            return False
        if response.status_code != 200:
            self.refused.append((replica.url, response.status_code, response.text[:300]))
            return False
        offsets = response.json()["offsets"]
        assert len(offsets) == len(events), response.text
        for event, position in zip(events, offsets, strict=True):
            self.acked.append(Acked(event, position["partition"], position["offset"], replica.url))
        return True

    async def ok(self, replica: Service, events: list[dict[str, Any]]) -> None:
        """``post``, which must be acknowledged."""
        assert await self.post(replica, events), f"append refused: {self.refused[-1]}"

    def episodes(self) -> set[str]:
        """Episodes whose ``episode.started`` was acknowledged."""
        return {a.event["episode"] for a in self.acked if a.event["type"] == "episode.started"}

    async def check_log(self, log_url: str) -> None:
        """Every acknowledged event is in the log, at the position its append answered."""
        from rolloutlog.log import open_log, split_record

        wanted: dict[int, dict[int, dict[str, Any]]] = {}
        for acked in self.acked:
            wanted.setdefault(acked.partition, {})[acked.offset] = acked.event
        async with open_log(log_url) as log:
            for partition, events in wanted.items():
                found: dict[int, tuple[Any, Any, Any]] = {}
                async for offset, record in log.read_records(
                    self.run, partition, min(events), max(events) + 1
                ):
                    meta = split_record(record)[0]
                    found[offset] = (meta.get("type"), meta.get("episode"), meta.get("seq"))
                for offset, sent in events.items():
                    assert found.get(offset) == (sent["type"], sent["episode"], sent["seq"]), (
                        f"acknowledged {sent['type']} of {sent['episode']} not at "
                        f"{partition}:{offset} (found {found.get(offset)})"
                    )

    async def close(self) -> None:
        await self.client.aclose()
