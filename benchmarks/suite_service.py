"""The service the suite measures: one ``rolloutlog serve`` subprocess per deployment (embedded,
or Kafka (Tansu) + PostgreSQL) with a fresh data directory and catalog, its CPU and RSS read from
/proc, and the ways a workload gets into it: through the SDK's transports (``sdk_load``) or in bulk
straight into its log while it is stopped (``bulk_preload``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT, append_in_chunks, serve_command, wait_ready
from prometheus_client.parser import text_string_to_metric_families
from workloads import Workload

from rolloutlog.log import open_log
from rolloutlog.participants import HttpTransport, KafkaTransport, Transport
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import free_port

PARTITIONS = 16


POSTGRES = os.environ.get(
    "ROLLOUTLOG_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Deployment:
    """Where a service keeps its log and catalog (embedded, or Kafka + PostgreSQL)."""

    name: str
    kafka: str | None = None
    prefix: str = field(default_factory=lambda: f"b{uuid.uuid4().hex[:8]}.")

    @property
    def log_url(self) -> str | None:
        return f"kafka://{self.kafka}?topic_prefix={self.prefix}" if self.kafka else None


class Service:
    """One ``rolloutlog serve`` subprocess with a fresh data directory; CPU and RSS from /proc."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.data_dir = Path(tempfile.mkdtemp(prefix="rolloutlog-suite-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        # A catalog of its own (a fresh schema): runs left by earlier suites, whose topics died
        # with their broker, would be reported lost and keep /readyz at 503.
        self.schema: str | None = None
        if deployment.log_url:
            self.schema = f"bench_{uuid.uuid4().hex[:12]}"
            postgres_execute(f'CREATE SCHEMA "{self.schema}"')

    def start(self) -> None:
        extra = []
        if self.deployment.log_url:
            catalog = f"{POSTGRES}{'&' if '?' in POSTGRES else '?'}search_path={self.schema}"
            extra = ["--log", self.deployment.log_url, "--catalog", catalog]
        with self.log_path.open("ab") as errors:  # warnings and errors, shown on failure
            self.proc = subprocess.Popen(
                serve_command(self.data_dir, self.port, *extra),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=errors,
            )
        wait_ready(self.url, self.proc, 180)  # a 64,000-episode catch-up on a busy machine

    @property
    def log_path(self) -> Path:
        return self.data_dir / "serve.log"

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _stat(self) -> list[str]:
        """The service's ``/proc/PID/stat`` fields after its name (the state is field 0)."""
        assert self.proc is not None
        return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()

    def cpu_s(self) -> float:
        fields = self._stat()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime

    def page_faults(self) -> int:
        """The service's minor page faults so far (pages it touched for the first time)."""
        return int(self._stat()[7])  # minflt

    def _status_mb(self, field: str) -> float:
        """A memory figure of the service's ``/proc/PID/status`` (``VmHWM``, ``VmRSS``) in MB."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def peak_rss_mb(self) -> float:
        return self._status_mb("VmHWM")

    def rss_mb(self) -> float:
        """The service's resident set now."""
        return self._status_mb("VmRSS")

    def reset_peak_rss(self) -> None:
        """Start VmHWM again from the current RSS (Linux: ``clear_refs`` 5), so that the next
        ``peak_rss_mb`` is the peak of what runs in between."""
        assert self.proc is not None
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is not None:  # it ended on its own: say how, before its log goes
                print(
                    f"rolloutlog serve ended with {self.proc.returncode}:\n{self.log_tail()}",
                    file=sys.stderr,
                )
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.schema is not None:
            postgres_execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
            self.schema = None


def postgres_execute(sql: str) -> None:
    """Run one statement on the suite's PostgreSQL (from sync code, inside or outside a loop)."""

    async def execute() -> None:
        import asyncpg

        conn = await asyncpg.connect(
            POSTGRES.split("?")[0].replace("postgresql+asyncpg", "postgresql")
        )
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, execute()).result()


@contextlib.contextmanager
def service(deployment: Deployment) -> Iterator[Service]:
    svc = Service(deployment)
    try:
        svc.start()
        yield svc
    finally:
        svc.remove()


def transport(svc: Service, **options: Any) -> Transport:
    """The deployment's SDK transport. On Kafka, ``validate=False``: the workloads' envelopes are
    plain dicts (checked by tests/test_benchmarks.py), not built by the SDK's participant classes,
    so the default would validate each with pydantic in the load generator, on the 2 cores the
    service needs."""
    log_url = svc.deployment.log_url
    if log_url:
        return KafkaTransport(log_url, url=svc.url, validate=False, **options)
    return HttpTransport(svc.url, **options)


async def sdk_load(svc: Service, run: str, workload: Workload) -> tuple[list[list[Any]], float]:
    """Append every episode through the SDK: one transport per participant shard (each keeps its
    participants' order), up to 8 chunks in flight per shard. Returns the episodes and seconds."""
    episodes = list(workload.episodes())
    # The benchmark process holds every envelope (the baselines reuse them): keep the collector
    # from rescanning them while it measures (as ``serve`` tunes its own collector).
    gc.collect()
    gc.freeze()
    shards: dict[int, list[list[dict[str, Any]]]] = {}
    for events in episodes:
        shard = int(events[0]["participant"]["id"].rsplit("-", 1)[1])
        shards.setdefault(shard, []).append(events)
    participants = workload.participants()

    async def one(shard: int, mine: list[list[dict[str, Any]]]) -> None:
        async with transport(svc) as t:
            for pid, kind in participants:
                if pid.endswith(f"-{shard}"):
                    await t.register(run, pid, kind)
            await append_in_chunks(t.append, run, mine, chunk_size=400, window=8)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(shard, mine) for shard, mine in shards.items()))
    return episodes, time.perf_counter() - t0


async def bulk_preload(svc: Service, run: str, workload: Workload) -> tuple[float, float]:
    """Preload straight into the deployment's log (the service is stopped meanwhile: the embedded
    log takes a lock; Kafka's topics outlive the service, and Tansu's its broker), streaming the
    episodes through ``KafkaTransport(log, validate=False)``: the SDK's encoder over an open
    ``rolloutlog.log`` backend, without the per-event validation (the workload's envelopes are
    validated by the tests). The restarted service catches up from the log. Returns the seconds
    of the preload and of the restart (until ``/readyz``: the projector's catch-up, here, ends
    before it answers; ``caught_up`` then waits for the rest)."""
    svc.stop()
    url = svc.deployment.log_url or f"embedded://{svc.data_dir.resolve()}"
    t0 = time.perf_counter()
    async with (
        open_log(url) as log,
        KafkaTransport(log, validate=False, max_batch=4096) as preload,
    ):
        await append_in_chunks(preload.append, run, workload.episodes(), chunk_size=4000, window=4)
    elapsed = time.perf_counter() - t0
    t0 = time.perf_counter()
    svc.start()
    return elapsed, time.perf_counter() - t0


async def caught_up(
    trainer: AsyncTrainerClient, run: str, live: int, timeout_s: float = 300
) -> float:
    """Wait until the service's projector holds ``live`` live episodes; returns seconds."""
    t0 = time.perf_counter()
    while True:
        counts = (await trainer.get_run(run)).get("counts", {})
        if counts.get("live_episodes", 0) >= live:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"projector did not catch up: {counts} (want {live} live)")
        await asyncio.sleep(0.1)


async def prepared(svc: Service, run: str, checkpoint_id: int, timeout_s: float = 60) -> str:
    """Wait until the service has prepared the lines of checkpoint ``checkpoint_id``'s restore
    (``rolloutlog_prepared_projection_lines``, off the checkpoint's path) or given up on them;
    returns the prepare's state (``ready``, ``skipped``, ``failed``; ``none`` when there is
    none, as on a replica that did not capture the checkpoint whole)."""
    wanted = {"run": run, "checkpoint_id": str(checkpoint_id)}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=svc.url, timeout=30) as client:
        while True:
            text = (await client.get("/metrics")).text
            state = next(
                (
                    sample.labels["state"]
                    for family in text_string_to_metric_families(text)
                    if family.name == "rolloutlog_prepared_projection_lines"
                    for sample in family.samples
                    if wanted.items() <= sample.labels.items()
                ),
                "none",
            )
            if state != "preparing":
                return state
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"checkpoint {checkpoint_id}'s prepare did not end")
            await asyncio.sleep(0.1)  # (a scrape costs the service a little)


@contextlib.asynccontextmanager
async def reader(svc: Service) -> AsyncIterator[Any]:
    # Beside the running service: read-only, so it takes no data-dir lock.
    url = svc.deployment.log_url or f"embedded://{svc.data_dir.resolve()}?read_only=1"
    async with open_log(url) as log:
        yield log
