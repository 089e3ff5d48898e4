"""The benchmark suite: checkpoints and restores at the seed's scale, beside the alternatives.

rolloutlog is measured through the real service: a ``rolloutlog serve`` subprocess per workload,
loaded with the SDK's transports (``HttpTransport`` on the embedded deployment, ``KafkaTransport``
on Kafka (Tansu) + PostgreSQL), checkpointed and restored over REST with ``rolloutlog.trainer``'s
client. Workloads S1-S4 are ``workloads.py``'s; the baselines (stop-the-world export,
pyeventsourcing on SQLite, the floor) are ``baselines.py``'s, on the same envelopes, in the same
run. Curves (both deployments): checkpoint and restore latency against live rollouts and
against state size; their episodes are preloaded straight into the deployment's log with
``rolloutlog.log`` (service stopped), then measured over REST on a restarted service. The HTTP
append figures are ``api_append.py``'s, run by this suite.

Saved to ``benchmarks/results/suite.json`` (``suite_quick.json`` with ``--quick``); ``report.py``
turns it into plots and ``benchmarks/RESULTS.md``.

    python benchmarks/suite.py [--quick] [--runs 5] [--backends embedded,kafka]
        [--parts main,appends,curves] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from _common import DEPLOYMENTS, ROOT, kafka_broker, percentile, save, serve_command, summary
from baselines import (
    eventsourcing_reconstruct,
    eventsourcing_store,
    floor,
    stop_the_world_checkpoint,
    stop_the_world_restore,
)
from workloads import (
    SHARDS,
    Workload,
    churn_batch,
    live_point,
    live_states,
    s1,
    s2,
    s3,
    state_point,
)

from rolloutlog.log import open_log
from rolloutlog.participants import HttpTransport, KafkaTransport, Transport
from rolloutlog.projections._projector import Projector, StartPlan
from rolloutlog.trainer import AsyncTrainerClient
from tests._services import free_port

PARTITIONS = 16
POSTGRES = os.environ.get(
    "ROLLOUTLOG_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
TICKS = os.sysconf("SC_CLK_TCK")

#: The targets (``report.py`` prints a row for each).
TARGETS = {
    "S1.checkpoint_vs_stop_the_world": 20.0,
    "curve_flatness": 2.0,
    "restore_and_fetch_over_floor": 1.5,
    "S4.checkpoint_over_S1": 2.0,
    "S1.restore_peak_rss_mb": 400.0,
    # Other parts of the suite (keys ``appends`` and ``fold_rate`` of the results).
    "appends.events_per_s": 50_000.0,
    "appends.p99_half_load_ms": 25.0,
    "fold_rate.events_per_s": 200_000.0,
}
SEED = {
    "S1": {
        "checkpoint_s": 1.43,
        "restore_s": 2.01,
        "note": "16,000 rollouts, two policy workers; "
        "the policy prepare stage took 2 s (25 s before an optimization)",
    },
    "S2": {
        "checkpoint_s": 3.6,
        "restore_s": 3.4,
        "note": "1,000 sessions of 350 KB "
        "(11.5 s / 6.0 s before); JSON encode/decode ~2 ms per 350 KB session",
    },
    "S3": {"restore_s": 1.5, "note": "importing 15,686 episodes' ledgers on restore"},
}


# -- the service --------------------------------------------------------------------------------


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
            _postgres_execute(f'CREATE SCHEMA "{self.schema}"')

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
        deadline = time.monotonic() + 180  # a 64,000-episode catch-up on a busy machine
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the service did not become ready")
            time.sleep(0.1)

    @property
    def log_path(self) -> Path:
        return self.data_dir / "serve.log"

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime

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
            _postgres_execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
            self.schema = None


def _postgres_execute(sql: str) -> None:
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
            pending: list[asyncio.Future[Any]] = []
            chunk: list[dict[str, Any]] = []
            for events in mine:
                chunk.extend(events)
                if len(chunk) >= 400:
                    pending.append(asyncio.ensure_future(t.append(run, chunk)))
                    chunk = []
                if len(pending) >= 8:
                    await pending.pop(0)
            if chunk:
                pending.append(asyncio.ensure_future(t.append(run, chunk)))
            await asyncio.gather(*pending)

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
        pending: list[asyncio.Future[Any]] = []
        chunk: list[dict[str, Any]] = []
        for events in workload.episodes():
            chunk.extend(events)
            if len(chunk) >= 4000:
                pending.append(asyncio.ensure_future(preload.append(run, chunk)))
                chunk = []
            if len(pending) >= 4:
                await pending.pop(0)
        if chunk:
            pending.append(asyncio.ensure_future(preload.append(run, chunk)))
        await asyncio.gather(*pending)
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


@contextlib.asynccontextmanager
async def reader(svc: Service) -> AsyncIterator[Any]:
    # Beside the running service: read-only, so it takes no data-dir lock.
    url = svc.deployment.log_url or f"embedded://{svc.data_dir.resolve()}?read_only=1"
    async with open_log(url) as log:
        yield log


# -- one workload on one deployment ----------------------------------------------------------------


#: Restores fetched by one fetcher per participant kind, per workload (after the single
#: stream's; the suite's time budget allows one).
PER_KIND_RUNS = 1
#: How many live rollouts move on by one event between two measured checkpoints: the same
#: count at every size, so the live-rollouts curve shows what a checkpoint costs per live
#: rollout when what changed stays the same.
CHURN_ROLLOUTS = 200


@contextlib.asynccontextmanager
async def advancing(
    svc: Service, run: str, workload: Workload
) -> AsyncIterator[Callable[[int], Awaitable[int]]]:
    """Yields a function that appends one round of ``workload.advance`` through the SDK (its
    participants registered again, with their new epochs) and lets the projector fold it."""
    kinds = {kind for _, kind in workload.participants()} & {"resources", "environment"}
    kind = "environment" if workload.name == "S3" else "resources"
    assert kind in kinds
    async with transport(svc) as t:
        epochs = {shard: await t.register(run, f"{kind}-{shard}", kind) for shard in range(SHARDS)}
        assert len(set(epochs.values())) == 1, epochs  # every shard registered as often

        async def advance(round_: int) -> int:
            events = workload.advance(round_, CHURN_ROLLOUTS, epochs[0])
            await t.append(run, events)
            await asyncio.sleep(0.3)  # folded by then: a live run's projector keeps up
            return len(events)

        yield advance


async def checkpoints_and_restores(
    svc: Service,
    trainer: AsyncTrainerClient,
    run: str,
    workload: Workload,
    runs: int,
    restores: int,
    per_kind: int = 0,
) -> dict[str, Any]:
    """Checkpoints as they happen in a live run, then restores.

    1. The first (cold) checkpoint of the service: its projector has no earlier one, so the
       whole manifest is written (``checkpoint_cold_s``).
    2. ``runs`` rounds of: ``CHURN_ROLLOUTS`` live rollouts advance (untimed), then a checkpoint
       (request → committed: ``checkpoint_s``).
    3. ``restores`` rounds of: floor (read + split what a restore of the newest checkpoint
       replays), restore (request → committed plan), fetching every projection of it (NDJSON
       stream, decoded as a participant would); before each round but the first, a new
       checkpoint (every episode changed: the restore gave it a new attempt), whose time is
       ``checkpoint_after_restore_s``.
    4. ``per_kind`` rounds of: a checkpoint, a restore and its fetch by one fetcher per
       participant kind in parallel (``fetch_per_kind``: ``restore_and_fetch_per_kind_s``).
    """
    live = workload.live
    figures: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[float]]] = {"checkpoint": {}, "restore": {}}
    cpu = {"checkpoint": 0.0, "restore": 0.0}

    async def checkpoint(figure: str) -> Any:
        before = svc.cpu_s()
        t0 = time.perf_counter()
        info = await trainer.checkpoint(run)
        figures.setdefault(figure, []).append(time.perf_counter() - t0)
        if figure == "checkpoint_s":
            cpu["checkpoint"] += svc.cpu_s() - before
        assert info.status == "committed", info
        assert info.counts["continue"] >= live, info.counts
        return info

    info = await checkpoint("checkpoint_cold_s")
    cold_stages = dict(info.timings_ms)
    advanced = 0
    async with advancing(svc, run, workload) as advance:
        for index in range(runs):
            advanced += await advance(index)
            info = await checkpoint("checkpoint_s")
            for stage, value in info.timings_ms.items():
                stages["checkpoint"].setdefault(stage, []).append(float(value))
    svc.reset_peak_rss()
    rss_after: list[float] = []
    for index in range(restores):
        if index:
            info = await checkpoint("checkpoint_after_restore_s")
        async with reader(svc) as log:
            floor_s, floor_bytes = await floor(log, run, info.offsets)
        before = svc.cpu_s()
        t0 = time.perf_counter()
        restored = await trainer.restore(run, checkpoint_id=info.checkpoint_id)
        restore_s = time.perf_counter() - t0
        assert restored.counts["continue"] >= live, restored.counts
        fetched = 0
        async for _ in trainer.projections(run, restored.restore_id):
            fetched += 1
        fetch_s = time.perf_counter() - t0
        cpu["restore"] += svc.cpu_s() - before
        assert fetched == restored.counts["continue"], (fetched, restored.counts)
        for stage, value in restored.timings_ms.items():
            stages["restore"].setdefault(stage, []).append(float(value))
        for key, value in {
            "restore_s": restore_s,
            "restore_and_fetch_s": fetch_s,
            "floor_s": floor_s,
            "restore_over_floor": restore_s / floor_s,
            "restore_and_fetch_over_floor": fetch_s / floor_s,
        }.items():
            figures.setdefault(key, []).append(value)
        figures.setdefault("floor_mb", []).append(floor_bytes / 1e6)
        rss_after.append(svc.rss_mb())
    out: dict[str, Any] = {key: summary(values) for key, values in figures.items()}
    # The service's peak RSS from the first restore to the last fetch (the checkpoint after a
    # restore included), not the load's.
    out["restore_peak_rss_mb"] = svc.peak_rss_mb()
    # The service's RSS after each restore's fetch, in order: flat, or growing with restores.
    out["rss_after_fetch_mb"] = rss_after
    if per_kind:
        # Beside the single stream: the same restore + fetch with one fetcher per participant
        # kind in parallel, as real Gyms fetch (each kind's stream holds what it restores, so
        # the kinds together receive more lines than the single stream).
        seconds, lines = [], 0
        for _ in range(per_kind):
            info = await trainer.checkpoint(run)
            t0 = time.perf_counter()
            restored = await trainer.restore(run, checkpoint_id=info.checkpoint_id)
            lines = await fetch_per_kind(trainer, run, restored.restore_id)
            seconds.append(time.perf_counter() - t0)
        out["restore_and_fetch_per_kind_s"] = summary(seconds)
        out["per_kind_lines"] = lines
    out["churn"] = {"rollouts_per_checkpoint": CHURN_ROLLOUTS, "events": advanced}
    # The service's own stage timings (its reply's ``timings_ms``): where the time went.
    out["stages_ms"] = {
        kind: {stage: statistics.median(values) for stage, values in per.items()}
        for kind, per in stages.items()
    }
    out["stages_ms"]["cold_checkpoint"] = cold_stages
    out["service_cpu_s_per_checkpoint"] = cpu["checkpoint"] / runs
    out["service_cpu_s_per_restore_and_fetch"] = cpu["restore"] / max(1, restores)
    return out


#: The participant kinds whose projections a restore serves (``kind=`` of the bulk route).
KINDS = ("environment", "policy", "resources", "agent")


async def fetch_per_kind(trainer: AsyncTrainerClient, run: str, restore_id: int) -> int:
    """A restore's projections fetched by one fetcher per participant kind, in parallel (each
    line decoded); returns the lines received in all."""

    async def one(kind: str) -> int:
        return sum([1 async for _ in trainer.projections(run, restore_id, kind=kind)])

    return sum(await asyncio.gather(*(one(kind) for kind in KINDS)))


def start_loader(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE)


async def saturated_checkpoints(
    svc: Service, trainer: AsyncTrainerClient, run: str, live: int, runs: int, writers: int
) -> dict[str, Any]:
    """S4: checkpoints while a separate process appends through the SDK as fast as the service
    acknowledges (closed loop, ``writers`` transports). A checkpoint before the load starts
    (untimed) is the previous one of the first measured, as in a live run (the restores before
    gave every episode a new attempt)."""
    await trainer.checkpoint(run)
    seconds = 2.5 + runs * 1.5
    cmd = [sys.executable, __file__, "--saturate", svc.url, run, str(seconds), str(writers)]
    if svc.deployment.log_url:
        cmd += ["--saturate-log", svc.deployment.log_url]
    loader = start_loader(cmd)
    try:
        await asyncio.sleep(1.5)  # registered and appending at full rate
        times = []
        stages: dict[str, list[float]] = {}
        before = svc.cpu_s()
        for _ in range(runs):
            t0 = time.perf_counter()
            info = await trainer.checkpoint(run)
            times.append(time.perf_counter() - t0)
            assert info.status == "committed", info
            assert info.counts["continue"] >= live, info.counts
            for stage, value in info.timings_ms.items():
                stages.setdefault(stage, []).append(float(value))
            await asyncio.sleep(0.3)
        cpu = svc.cpu_s() - before
        out_bytes, _ = await asyncio.to_thread(loader.communicate, timeout=seconds + 120)
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait()
    appends = orjson.loads(out_bytes.strip().splitlines()[-1])
    return {
        "checkpoint_s": summary(times),
        # The service's own stage timings, as S1's: queueing on the event loop behind the
        # appends is what the request's time has beyond their ``total``.
        "stages_ms": {
            "checkpoint": {stage: statistics.median(values) for stage, values in stages.items()}
        },
        "appends": appends,
        "service_cpu_s_during": cpu,
    }


async def measure_workload(
    deployment: Deployment, workload: Workload, runs: int, restores: int, saturate: bool
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One workload on a fresh service: SDK load, checkpoints, floors, restores and fetches; with
    ``saturate`` (S1), then S4 on the same service (its churn episodes are new ones, so the
    restores before it do not fence them)."""
    with service(deployment) as svc:
        run = f"{workload.name.lower()}-{uuid.uuid4().hex[:6]}"
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.create_run(run, PARTITIONS)
            await trainer.take_over(run)
            cpu0 = svc.cpu_s()
            episodes, load_s = await sdk_load(svc, run, workload)
            try:
                catch_up_s = await caught_up(trainer, run, workload.live)
            except RuntimeError:
                log(f"the service's log (last lines):\n{svc.log_tail()}")
                raise
            load_cpu = svc.cpu_s() - cpu0
            out = await checkpoints_and_restores(
                svc, trainer, run, workload, runs, restores, per_kind=PER_KIND_RUNS
            )
            out.update(
                {
                    "episodes": workload.count,
                    "live": workload.live,
                    "events": sum(len(e) for e in episodes),
                    "load_s": load_s,
                    "load_events_per_s": sum(len(e) for e in episodes) / load_s,
                    "catch_up_s": catch_up_s,
                    "service_cpu_s_load": load_cpu,
                }
            )
            s4_out = None
            if saturate:
                s4_out = await saturated_checkpoints(svc, trainer, run, workload.live, runs, 4)
            out["service_peak_rss_mb"] = svc.peak_rss_mb()
            out["service_cpu_s_total"] = svc.cpu_s()
    if s4_out is not None:
        out["S4"] = s4_out
    return out, episodes


def measure_baselines(
    workload: Workload, episodes: list[list[Any]], runs: int, restores: int, eventsourcing: bool
) -> dict[str, Any]:
    states = live_states(episodes)
    out: dict[str, Any] = {}
    directory = Path(tempfile.mkdtemp(prefix="rolloutlog-baselines-"))
    try:
        stw, stw_restore, figures = [], [], []
        for index in range(runs):
            target = directory / f"stw{index}"
            figures.append(asyncio.run(stop_the_world_checkpoint(states, target)))
            stw.append(figures[-1]["checkpoint_s"])
            seconds, restored = stop_the_world_restore(target)
            assert restored == workload.live, (restored, workload.live)
            stw_restore.append(seconds)
            shutil.rmtree(target)
        out["stop_the_world"] = {
            "checkpoint_s": summary(stw),
            "restore_s": summary(stw_restore),
            **{
                f"{key}": summary([f[key] for f in figures])
                for key in ("park_s", "export_s", "resume_s")
            },
            "export_mb": figures[-1]["bytes"] / 1e6,
        }
        del states
        if eventsourcing:
            db = directory / "eventsourcing.sqlite3"
            store_s, live = eventsourcing_store(db, episodes)
            assert len(live) == workload.live
            rebuilt = [eventsourcing_reconstruct(db, live) for _ in range(restores)]
            out["eventsourcing"] = {"store_s": store_s, "reconstruct_s": summary(rebuilt)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


# -- curves ----------------------------------------------------------------------------------------


async def curve_point(
    deployment: Deployment, workload: Workload, runs: int, restores: int
) -> dict[str, Any]:
    """One curve point on a fresh service of ``deployment``: the run created over REST, its
    episodes preloaded in bulk (``bulk_preload``), then measured like a workload. On Kafka the
    run's topics are deleted afterwards (Tansu keeps them in memory as long as it runs)."""
    with service(deployment) as svc:
        run = f"{workload.name}-{workload.count}-{workload.state_bytes}"
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.create_run(run, PARTITIONS)
        preload_s, restart_s = await bulk_preload(svc, run, workload)
        async with AsyncTrainerClient(svc.url) as trainer:
            await trainer.take_over(run)
            try:
                catch_up_s = await caught_up(trainer, run, workload.live, timeout_s=600)
            except RuntimeError:
                log(f"the service's log (last lines):\n{svc.log_tail()}")
                raise
            out = await checkpoints_and_restores(svc, trainer, run, workload, runs, restores)
            out["service_peak_rss_mb"] = svc.peak_rss_mb()
        svc.stop()
        if deployment.log_url:
            async with open_log(deployment.log_url) as kafka_log:
                await kafka_log.delete_run(run)
    out.update(
        {
            "live": workload.live,
            "state_bytes": workload.state_bytes,
            "preload_s": preload_s,
            "restart_s": restart_s,
            "catch_up_s": catch_up_s,
        }
    )
    return out


def stw_point(workload: Workload, runs: int) -> dict[str, Any]:
    states = live_states(list(workload.episodes()))
    directory = Path(tempfile.mkdtemp(prefix="rolloutlog-stw-"))
    try:
        times, restores = [], []
        for index in range(runs):
            target = directory / str(index)
            times.append(asyncio.run(stop_the_world_checkpoint(states, target))["checkpoint_s"])
            restores.append(stop_the_world_restore(target)[0])
            shutil.rmtree(target)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"checkpoint_s": summary(times), "restore_s": summary(restores)}


#: Runs at curve points, fewer than the workloads' (``--runs``) so that the whole suite stays
#: within ~15 minutes here: live checkpoints, restores (each after its floor, and every one but
#: the first after a checkpoint), restores at the largest live-rollouts point, stop-the-world
#: checkpoints (each with its restore). Every figure's ``runs`` says how many it took.
CURVE_RUNS = {"checkpoints": 3, "restores": 2, "largest_restores": 1, "stop_the_world": 3}
#: Wall seconds a curve point is expected to take here (the largest live-rollouts point: its
#: preload, catch-up, checkpoints, restore and stop-the-world runs; any other: ~10-25 s): a point
#: starts only if the suite's ``--budget-s`` still has that much room.
POINT_S = {"largest": 150.0, "other": 25.0}


def measure_curves(
    results: dict[str, Any],
    backends: list[str],
    kafka: str | None,
    quick: bool,
    started: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Checkpoint and restore against live rollouts and against state size, on each deployment.

    Every point but the main part's S1 (the 16,000 live-rollouts point, reused with its runs) is
    preloaded in bulk (``curve_point``). The stop-the-world baseline of a point is measured once
    and shared by the deployments. Points run smallest first, each deployment in turn; the largest
    live point of each deployment comes last, within ``--budget-s``."""
    live_counts = [500, 1000] if quick else [1000, 4000, 16_000, 64_000]
    state_sizes = [1024, 1024 * 1024] if quick else [1024, 32 * 1024, 1024 * 1024]
    if args.live_points is not None:  # a before/after of a few points
        live_counts = [int(x) for x in args.live_points.split(",") if x]
    if args.state_points is not None:
        state_sizes = [int(x) for x in args.state_points.split(",") if x]
    state_count = 50 if quick else 200
    counts = {key: 2 if quick else n for key, n in CURVE_RUNS.items()}
    largest = max(live_counts, default=0)
    plan = [
        (name, curve, x)
        for name in backends
        for curve, x in [("live", c) for c in live_counts if c != largest]
        + [("state", size) for size in state_sizes]
    ]
    plan += [(name, "live", largest) for name in backends]
    stw: dict[tuple[str, int], dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, curve, x in plan:
        deployment = Deployment(name, kafka if name == "kafka" else None)
        mine = out.setdefault(
            name,
            {
                "live_rollouts": {},
                "state_bytes": {},
                "state_rollouts": state_count,
                "runs": counts,
            },
        )
        main_s1 = results["deployments"].get(name, {}).get("S1")
        elapsed = time.perf_counter() - started
        reused = curve == "live" and main_s1 is not None and main_s1["live"] == x
        needed = POINT_S["largest" if x == largest else "other"]
        if elapsed + needed > args.budget_s and not reused:
            log(f"curve {name} {curve} {x}: skipped (time budget)")
            results["skipped"].append(
                f"{DEPLOYMENTS[name]} {curve} curve point {x}: skipped, the suite had used "
                f"{elapsed:.0f} s of its {args.budget_s:.0f} s budget (`--budget-s`) and the "
                f"point takes ~{needed:.0f} s"
            )
            continue
        workload = live_point(x) if curve == "live" else state_point(state_count, x)
        if reused:
            # S1 is this point (same episodes, same deployment, loaded through the SDK).
            assert main_s1 is not None
            point = {k: v for k, v in main_s1.items() if isinstance(v, dict)}
            point.update(live=x, state_bytes=0, from_workload="S1")
            baseline = results["baselines"].get("S1", {}).get("stop_the_world")
            if baseline:
                point["stop_the_world"] = baseline
        else:
            log(f"curve {name}: {workload.count} live rollouts, {workload.state_bytes} B states")
            restores = counts["largest_restores" if x == largest else "restores"]
            point = asyncio.run(curve_point(deployment, workload, counts["checkpoints"], restores))
            if not args.no_baselines:  # a before/after of rolloutlog's points needs none
                if (curve, x) not in stw:
                    stw[(curve, x)] = stw_point(workload, counts["stop_the_world"])
                point["stop_the_world"] = stw[(curve, x)]
        mine["live_rollouts" if curve == "live" else "state_bytes"][str(x)] = point
        log(
            f"  {name} {curve} {x}: checkpoint {point['checkpoint_s']['median'] * 1e3:.0f} ms, "
            f"restore {point['restore_s']['median'] * 1e3:.0f} ms (+fetch "
            f"{point['restore_and_fetch_s']['median'] * 1e3:.0f} ms; preload "
            f"{point.get('preload_s', 0):.0f} s)"
        )
    return out


#: Runs and seconds per phase of the HTTP append part (``api_append.measure``).
APPEND_RUNS = {"full": (3, 4.0), "quick": (1, 2.0)}


def http_appends(runs_and_seconds: tuple[int, float]) -> dict[str, Any]:
    """The HTTP append figures, measured by ``benchmarks/api_append.py`` (its ``measure``:
    a fresh ``rolloutlog serve`` on the embedded log per run, with the service's default options;
    8 clients, batches of 100, closed loop → events/s; then paced at half that → p50/p99)."""
    import api_append

    runs, seconds = runs_and_seconds
    figures = api_append.measure(runs, seconds, [], {"this tree": ROOT})["this tree"]
    return {
        **figures,
        "runs": runs,
        "seconds_per_phase": seconds,
        "batch": api_append.BATCH,
        "clients": api_append.CLIENTS,
    }


# -- the projector's fold rate on Kafka -------------------------------------------------------------


async def fold_rate(kafka: str, workload: Workload, runs: int) -> dict[str, Any]:
    """How fast a projector reads and folds a run from Kafka: the workload is appended straight
    into the log (no service), then ``runs`` fresh projectors each catch up from offset 0; the
    rate is records folded per second of catch-up (read from the broker + fold, one process)."""
    run = f"fold-{uuid.uuid4().hex[:6]}"
    async with open_log(f"kafka://{kafka}?topic_prefix=f{uuid.uuid4().hex[:8]}.") as log:
        await log.ensure_run(run, PARTITIONS)
        pending: list[asyncio.Future[Any]] = []
        chunk: list[dict[str, Any]] = []
        for events in workload.episodes():
            chunk.extend(events)
            if len(chunk) >= 2000:
                pending.append(asyncio.ensure_future(log.append(run, chunk)))
                chunk = []
            if len(pending) >= 8:
                await pending.pop(0)
        if chunk:
            pending.append(asyncio.ensure_future(log.append(run, chunk)))
        await asyncio.gather(*pending)
        records = sum(await log.end_offsets(run))
        rates, seconds = [], []
        for _ in range(runs):
            projector = Projector(log, run, PARTITIONS)

            async def plan() -> StartPlan:
                return StartPlan([0] * PARTITIONS)

            t0 = time.perf_counter()
            projector.launch(plan)
            await projector.settled.wait()
            elapsed = time.perf_counter() - t0
            assert projector.health.status == "ok", projector.health
            assert projector.events_applied == records, (projector.events_applied, records)
            assert len(projector.trackers) >= workload.live, len(projector.trackers)
            await projector.stop()
            del projector
            gc.collect()
            seconds.append(elapsed)
            rates.append(records / elapsed)
        await log.delete_run(run)
    return {
        "records": records,
        "live": workload.live,
        "catch_up_s": summary(seconds),
        "events_per_s": summary(rates),
    }


# -- S4's load generator (a subprocess) ------------------------------------------------------------


async def saturate(url: str, run: str, seconds: float, writers: int, log_url: str | None) -> None:
    latencies: list[float] = []
    done = 0

    async def writer(index: int) -> None:
        nonlocal done
        options: dict[str, Any] = {"max_batch": 100}
        t: Transport = (
            KafkaTransport(log_url, url=url, **options)
            if log_url
            else HttpTransport(url, **options)
        )
        async with t:
            epoch = await t.register(run, f"churn-{index}", "environment")
            seq = 1
            stop_at = started + seconds
            while time.perf_counter() < stop_at:
                batch = churn_batch(index, epoch, seq, 100)
                seq += 100
                t0 = time.perf_counter()
                await t.append(run, batch)
                latencies.append(time.perf_counter() - t0)
                done += len(batch)

    started = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    elapsed = time.perf_counter() - started
    result = {
        "writers": writers,
        "batch": 100,
        "events_per_s": done / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "requests": len(latencies),
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


# -- main ------------------------------------------------------------------------------------------


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("rolloutlog", "eventsourcing", "fastapi", "uvicorn", "aiokafka", "sqlalchemy"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    try:
        out["postgresql"] = asyncio.run(_postgres_version())
    except Exception:  # the version is informative only
        out["postgresql"] = "unknown"
    return out


async def _postgres_version() -> str:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES.replace("postgresql+asyncpg", "postgresql"))
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="embedded,kafka")
    parser.add_argument("--parts", default="main,appends,curves")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 runs (smoke test)")
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="rolloutlog's figures only, curve points included (a before/after comparison of "
        "two commits needs no more)",
    )
    parser.add_argument("--workloads", default="S1,S2,S3", help="of the main part")
    parser.add_argument(
        "--save-as",
        help="results/NAME.json instead of suite.json (a partial run must not replace it)",
    )
    parser.add_argument("--saturate", nargs=4, metavar=("URL", "RUN", "SECONDS", "WRITERS"))
    parser.add_argument("--saturate-log")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=930.0,
        help="the suite's wall-time budget: a curve point that would end past it is skipped "
        "(and listed as skipped; default: %(default)s)",
    )
    parser.add_argument(
        "--live-points",
        help="the live-rollouts points of the curves part, comma-separated (default: "
        "1000,4000,16000,64000; empty: none)",
    )
    parser.add_argument(
        "--state-points",
        help="the state-size points (bytes) of the curves part, comma-separated (default: "
        "1024,32768,1048576; empty: none)",
    )
    args = parser.parse_args()
    # Tansu has no idempotent producer: its warning per producer is known (see RESULTS.md).
    for name in ("aiokafka", "rolloutlog.log.kafka"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.saturate:
        url, run, seconds, writers = args.saturate
        asyncio.run(saturate(url, run, float(seconds), int(writers), args.saturate_log))
        return
    # A terminated suite still stops what it started (services, the broker): exit through the
    # context managers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    quick = args.quick
    runs = 2 if quick else args.runs
    backends = [b for b in args.backends.split(",") if b]
    parts = args.parts.split(",")
    sizes = (
        {"S1": s1(1000), "S2": s2(100), "S3": s3(1000, 150)}
        if quick
        else {"S1": s1(), "S2": s2(), "S3": s3()}
    )
    sizes = {key: workload for key, workload in sizes.items() if key in args.workloads.split(",")}
    results: dict[str, Any] = {
        "quick": quick,
        "runs": runs,
        "versions": versions(),
        "targets": TARGETS,
        "seed": SEED,
        "deployments": {},
        "baselines": {},
        "curves": {},
        "skipped": [],
        # Wall seconds of each part of this run (where the suite's time goes).
        "part_seconds": {},
    }
    if "kafka" in backends and results["versions"]["postgresql"] == "unknown":
        # A clone without the services still measures the embedded deployment (and says so).
        backends.remove("kafka")
        results["skipped"].append(f"Kafka + PostgreSQL deployment: no PostgreSQL at {POSTGRES}")
        log(results["skipped"][-1])
    with kafka_broker("kafka" in backends and "main" in parts) as kafka:
        part_started = time.perf_counter()
        if "main" in parts:
            for name in backends:
                deployment = Deployment(name, kafka if name == "kafka" else None)
                per: dict[str, Any] = {}
                for key, workload in sizes.items():
                    if quick and name != backends[0] and key != "S1":
                        continue  # quick: the second deployment's S1 (and S4) only
                    log(f"{name} {key}: {workload.count} episodes")
                    figures, episodes = asyncio.run(
                        measure_workload(
                            deployment,
                            workload,
                            runs,
                            runs,
                            saturate=key == "S1",
                        )
                    )
                    s4 = figures.pop("S4", None)
                    per[key] = figures
                    if s4 is not None:
                        per["S4"] = s4
                    log(
                        f"  checkpoint {figures['checkpoint_s']['median'] * 1e3:.0f} ms, restore "
                        f"{figures['restore_s']['median'] * 1e3:.0f} ms (+fetch "
                        f"{figures['restore_and_fetch_s']['median'] * 1e3:.0f} ms), floor "
                        f"{figures['floor_s']['median'] * 1e3:.0f} ms; load {figures['load_s']:.1f} s"
                        + (
                            f"; S4 checkpoint {s4['checkpoint_s']['median'] * 1e3:.0f} ms at "
                            f"{s4['appends']['events_per_s']:.0f} events/s, p99 "
                            f"{s4['appends']['p99_ms']:.0f} ms"
                            if s4
                            else ""
                        )
                    )
                    if name == backends[0] and not args.no_baselines:
                        log(f"  baselines on {key}")
                        results["baselines"][key] = measure_baselines(
                            workload, episodes, runs, runs, eventsourcing=key in ("S1", "S2")
                        )
                        log(f"  {results['baselines'][key]}")
                    del episodes
                results["deployments"][name] = per
            if kafka is not None:
                log("projector fold rate on Kafka (S1's episodes)")
                results["fold_rate"] = asyncio.run(fold_rate(kafka, sizes["S1"], 2 if quick else 3))
                log(f"  {results['fold_rate']['events_per_s']['median']:.0f} events/s")
            results["part_seconds"]["main"] = time.perf_counter() - part_started
    if "appends" in parts:
        log("HTTP append (benchmarks/api_append.py, embedded, the service's defaults)")
        part_started = time.perf_counter()
        results["appends"] = http_appends(APPEND_RUNS["quick" if quick else "full"])
        results["part_seconds"]["appends"] = time.perf_counter() - part_started
        log(
            f"  {results['appends']['events_per_s']['median']:.0f} events/s, p99 at half load "
            f"{results['appends']['half_load_p99_ms']['median']:.1f} ms"
        )
    if "curves" in parts:
        part_started = time.perf_counter()
        with kafka_broker("kafka" in backends) as kafka:
            results["curves"] = measure_curves(results, backends, kafka, quick, started, args)
        results["part_seconds"]["curves"] = time.perf_counter() - part_started
    results["ratios"] = ratios(results)
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_after"] = os.getloadavg()
    path = save(args.save_as or "suite" + ("_quick" if quick else ""), results)
    log(f"saved {path} ({results['elapsed_s']:.0f} s)")


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each deployment's medians against the baselines measured in the same run."""
    out: dict[str, Any] = {}
    for name, per in results["deployments"].items():
        mine: dict[str, float] = {}
        for key, figures in per.items():
            base = results["baselines"].get(key, {})
            if key == "S4":
                mine["S4.checkpoint_over_S1"] = ratio(
                    figures["checkpoint_s"]["median"], per["S1"]["checkpoint_s"]["median"]
                )
                continue
            stw = base.get("stop_the_world")
            if stw:
                mine[f"{key}.checkpoint_vs_stop_the_world"] = ratio(
                    stw["checkpoint_s"]["median"], figures["checkpoint_s"]["median"]
                )
                if "checkpoint_cold_s" in figures:
                    mine[f"{key}.cold_checkpoint_vs_stop_the_world"] = ratio(
                        stw["checkpoint_s"]["median"], figures["checkpoint_cold_s"]["median"]
                    )
            if stw and "restore_and_fetch_s" in figures:
                mine[f"{key}.restore_and_fetch_vs_stop_the_world_restore"] = ratio(
                    stw["restore_s"]["median"], figures["restore_and_fetch_s"]["median"]
                )
            es = base.get("eventsourcing")
            if es:
                mine[f"{key}.restore_and_fetch_vs_eventsourcing"] = ratio(
                    es["reconstruct_s"]["median"], figures["restore_and_fetch_s"]["median"]
                )
            mine[f"{key}.restore_over_floor"] = figures["restore_over_floor"]["median"]
        out[name] = mine
    for name, curves in results.get("curves", {}).items():
        for curve in ("live_rollouts", "state_bytes"):
            points = curves.get(curve) or {}
            for key in ("checkpoint_s", "checkpoint_cold_s", "restore_s"):
                medians = [p[key]["median"] for p in points.values() if key in p]
                if len(medians) < 2:
                    continue
                out.setdefault("curves", {}).setdefault(name, {})[f"{curve}.{key}.max_over_min"] = (
                    ratio(max(medians), min(medians))
                )
    return out


if __name__ == "__main__":
    main()
