"""HTTP append through a real ``rolloutlog serve`` (uvicorn) on the embedded backend.

Per run, a fresh server in a subprocess and a fresh data directory:

1. throughput: 8 concurrent clients, each on its own keep-alive connection, POST batches of 100
   ~250-byte events as fast as the server acknowledges them (closed loop) → events/s;
2. latency: the same clients at half the measured throughput, paced (open loop) → p50/p99 of
   request latency;
3. memory: 16,000 episodes started and given a boundary (all live) → the server's RSS, read
   from /proc, and the projector's live episode count from /metrics.

The clients speak HTTP/1.1 over asyncio streams directly (a few microseconds per request), so
that on this 2-core machine they take as little CPU from the server as possible. Each figure is
the median (min, max) of ``--runs`` runs; results go to ``benchmarks/results/api_append.json``.

    python benchmarks/api_append.py [--runs 5] [--seconds 6] [--workers 0,1] [--quick]
    python benchmarks/api_append.py --compare db22c52 [--runs 3] [--workers 0]

Each configuration (``serve --validation-workers N``) is measured separately; the first is the
headline (the default of ``serve`` on this machine), the others are kept for comparison.

With ``--compare REF`` the service of git ``REF`` (its ``rolloutlog`` package, extracted into
a temporary directory, run with this venv) and this tree's are measured alternately, run by
run, on the same machine at the same time (``api_append_before_after.json``, for the commit
message; not committed). Every run also
records the service process's CPU time per event during the throughput phase (user + system,
from /proc: its HTTP server, validation, log writer threads and projector together).
``--synchronous NORMAL`` runs the embedded log without an fsync per commit group (taking the
disk's latency out of the comparison); ``--kafka`` logs to Kafka instead (a Tansu broker, each server its own topic prefix; the catalog
stays SQLite in the server's data directory).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from _common import ROOT, kafka_broker, percentile, save, serve_command, summary

from tests._services import free_port

RUN = "bench"
BATCH = 100
CLIENTS = 8
LIVE_EPISODES = 16_000
TARGETS = {"events_per_s": 50_000, "p99_ms_at_half_load": 25.0, "rss_mb_16k_live": 250.0}


def boundary(i: int, seq: int, who: str = "env-0") -> dict[str, Any]:
    return {
        "v": 1,
        "type": "step.boundary",
        "episode": f"r{i % 4096}",
        "attempt": 0,
        "step": seq % 50,
        "participant": {"id": who, "kind": "environment", "epoch": 1},
        "seq": seq,
        "ts": 1764400000.0 + seq,
        "data": {
            "owner": "environment",
            "stage": "invoke_agent",
            "next": "close_agent",
            "state": {"turn": seq % 7, "note": "x" * 40},
        },
    }


def started(i: int, seq: int) -> dict[str, Any]:
    task = {"prompt": f"task {i}"}
    return {
        "v": 1,
        "type": "episode.started",
        "episode": f"live{i}",
        "participant": {"id": "env-live", "kind": "environment", "epoch": 1},
        "seq": seq,
        "ts": 1764400000.0,
        "data": {"task": task, "task_digest": "0" * 64, "deadline_s": 600.0},
    }


class Connection:
    """One keep-alive HTTP/1.1 connection (enough of the protocol for this benchmark)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


#: Extra ``serve`` arguments of the configuration being measured.
SERVE_ARGS: list[str] = []
#: A Kafka bootstrap address: each server then logs to it (its own topic prefix) with its
#: catalog in its data directory; None: the embedded log.
KAFKA: list[str] = []
#: The embedded log's ``synchronous`` setting, when not the default (FULL).
SYNCHRONOUS: list[str] = []


class Server:
    def __init__(self, tree: Path = ROOT) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="rolloutlog-api-bench-"))
        self.port = free_port()
        self.tree = tree
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = [f"--log=kafka://{KAFKA[0]}?topic_prefix=b{uuid.uuid4().hex[:8]}."] if KAFKA else []
        if SYNCHRONOUS:
            log = [f"--log=embedded://{self.data_dir.resolve()}?synchronous={SYNCHRONOUS[0]}"]
        # ``python -m`` imports ``rolloutlog`` from the working directory first.
        self.proc = subprocess.Popen(
            serve_command(self.data_dir, self.port, *SERVE_ARGS, *log),
            cwd=self.tree,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                conn = Connection(self.port)
                await conn.open()
                status, _ = await conn.request("GET", "/readyz")
                conn.close()
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def rss_mb(self) -> float:
        """RSS of the server and any processes it started (validation workers)."""
        assert self.proc is not None
        pids = [self.proc.pid]
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        if children.exists():
            pids.extend(int(pid) for pid in children.read_text().split())
        total = 0.0
        for pid in pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        return total

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (all its threads)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def bodies(count: int, first_seq: int, who: str = "env-0") -> list[bytes]:
    out = []
    seq = first_seq
    for _ in range(count):
        out.append(orjson.dumps([boundary(seq + k, seq + k, who) for k in range(BATCH)]))
        seq += BATCH
    return out


async def throughput(port: int, seconds: float, seq: int) -> tuple[float, int]:
    """Closed loop: every client sends its next batch as soon as the last one is acknowledged."""
    # One participant per client (each with its own seqs: the service refuses seqs that jump
    # absurdly past a participant's highest).
    per_client = [bodies(int(seconds * 120), seq, f"env-{c}") for c in range(CLIENTS)]
    connections = [Connection(port) for _ in range(CLIENTS)]
    for conn in connections:
        await conn.open()
    done = 0
    stop_at = 0.0

    async def client(conn: Connection, payloads: list[bytes]) -> None:
        nonlocal done
        for body in payloads:
            if time.perf_counter() >= stop_at:
                return
            status, reply = await conn.request("POST", f"/v1/runs/{RUN}/events", body)
            if status != 200:
                raise RuntimeError(f"append failed: {status} {reply[:200]!r}")
            done += BATCH

    started_at = time.perf_counter()
    stop_at = started_at + seconds
    await asyncio.gather(*(client(c, p) for c, p in zip(connections, per_client, strict=True)))
    elapsed = time.perf_counter() - started_at
    for conn in connections:
        conn.close()
    return done / elapsed, seq + int(seconds * 120) * BATCH


#: Events of the fixed-work phase (whose service CPU is the least load-sensitive figure).
STEADY_EVENTS = 40_000


async def steady_cpu(server: Server, seq: int) -> float:
    """Service CPU microseconds per event for a fixed ``STEADY_EVENTS`` (8 clients, closed loop)
    once every episode exists, counted until the projector has folded them too (1 s after)."""
    per_client = STEADY_EVENTS // BATCH // CLIENTS
    payloads = [bodies(per_client, seq, f"env-{c}") for c in range(CLIENTS)]
    connections = [Connection(server.port) for _ in range(CLIENTS)]
    for conn in connections:
        await conn.open()

    async def client(conn: Connection, bodies_: list[bytes]) -> None:
        for body in bodies_:
            status, reply = await conn.request("POST", f"/v1/runs/{RUN}/events", body)
            if status != 200:
                raise RuntimeError(f"append failed: {status} {reply[:200]!r}")

    before = server.cpu_s()
    await asyncio.gather(*(client(c, p) for c, p in zip(connections, payloads, strict=True)))
    await asyncio.sleep(1.0)
    for conn in connections:
        conn.close()
    return (server.cpu_s() - before) / (per_client * CLIENTS * BATCH) * 1e6


async def latency(
    port: int, events_per_s: float, seconds: float, seq: int
) -> tuple[dict[str, float], int]:
    """Open loop at ``events_per_s``: requests leave on schedule whether or not others finished."""
    requests_per_s = events_per_s / BATCH
    total = max(int(requests_per_s * seconds), CLIENTS)
    per_client = -(-total // CLIENTS)
    payloads = [bodies(per_client, seq, f"env-{c}") for c in range(CLIENTS)]
    connections = [Connection(port) for _ in range(CLIENTS)]
    for conn in connections:
        await conn.open()
    latencies: list[float] = []
    interval = CLIENTS / requests_per_s
    started_at = time.perf_counter() + 0.05

    async def client(index: int, conn: Connection) -> None:
        for n, body in enumerate(payloads[index]):
            due = started_at + (n + index / CLIENTS) * interval
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            status, _ = await conn.request("POST", f"/v1/runs/{RUN}/events", body)
            if status != 200:
                raise RuntimeError(f"append failed: {status}")
            # From when it was due: a request delayed by a slow predecessor counts its wait.
            latencies.append(time.perf_counter() - min(sent, max(due, sent - 1)))

    await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    for conn in connections:
        conn.close()
    figures = {
        "requests_per_s": requests_per_s,
        "events_per_s": events_per_s,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "requests": len(latencies),
    }
    return figures, seq + per_client * BATCH


async def live_memory(server: Server) -> dict[str, float]:
    conn = Connection(server.port)
    await conn.open()
    status, _ = await conn.request(
        "POST", f"/v1/runs/{RUN}/participants", b'{"id": "env-live", "kind": "environment"}'
    )
    assert status == 201, status
    seq = 1
    for first in range(0, LIVE_EPISODES, 500):
        batch = []
        for i in range(first, min(first + 500, LIVE_EPISODES)):
            batch.append(started(i, seq))
            event = boundary(0, seq + 1)
            event["episode"] = f"live{i}"
            event["participant"] = {"id": "env-live", "kind": "environment", "epoch": 1}
            batch.append(event)
            seq += 2
        status, reply = await conn.request("POST", f"/v1/runs/{RUN}/events", orjson.dumps(batch))
        assert status == 200, reply[:300]
    live = 0.0
    for _ in range(100):  # the projector follows the log: wait until it has caught up
        status, text = await conn.request("GET", "/metrics")
        for line in text.decode().splitlines():
            if line.startswith("rolloutlog_live_episodes{"):
                live = float(line.rsplit(" ", 1)[1])
        if live >= LIVE_EPISODES:
            break
        await asyncio.sleep(0.1)
    conn.close()
    return {"rss_mb": server.rss_mb(), "live_episodes": live}


async def started_server(tree: Path) -> Server:
    server = Server(tree)
    server.start()
    await server.wait_ready()
    conn = Connection(server.port)
    await conn.open()
    for path, body in (
        ("/v1/runs", orjson.dumps({"run": RUN, "partitions": 16})),
        *(
            (f"/v1/runs/{RUN}/participants", b'{"id": "env-%d", "kind": "environment"}' % c)
            for c in range(CLIENTS)
        ),
    ):
        status, reply = await conn.request("POST", path, body)
        assert status == 201, reply
    conn.close()
    return server


async def one_run(seconds: float, tree: Path = ROOT) -> dict[str, Any]:
    # Throughput and latency on one server; memory on a fresh one, so that exactly 16,000
    # episodes are live (and its catalog bookkeeping does not disturb the latency phase).
    server = await started_server(tree)
    try:
        rss_idle = server.rss_mb()
        cpu_before, started_at = server.cpu_s(), time.perf_counter()
        rate, seq = await throughput(server.port, seconds, 1)
        events = rate * (time.perf_counter() - started_at)
        cpu_us_per_event = (server.cpu_s() - cpu_before) / events * 1e6
        half, seq = await latency(server.port, rate / 2, seconds, seq)
        steady = await steady_cpu(server, seq)
    finally:
        server.stop()
    server = await started_server(tree)
    try:
        memory = await live_memory(server)
    finally:
        server.stop()
    return {
        "events_per_s": rate,
        "cpu_us_per_event": cpu_us_per_event,
        "steady_cpu_us_per_event": steady,
        "half_load": half,
        "rss_mb_idle": rss_idle,
        "rss_mb_16k_live": memory["rss_mb"],
        "live_episodes": memory["live_episodes"],
    }


def _summaries(results: list[dict[str, Any]], serve_args: list[str]) -> dict[str, Any]:
    return {
        "serve_args": serve_args,
        "events_per_s": summary([r["events_per_s"] for r in results]),
        "cpu_us_per_event": summary([r["cpu_us_per_event"] for r in results]),
        "steady_cpu_us_per_event": summary([r["steady_cpu_us_per_event"] for r in results]),
        "half_load_p50_ms": summary([r["half_load"]["p50_ms"] for r in results]),
        "half_load_p99_ms": summary([r["half_load"]["p99_ms"] for r in results]),
        "half_load_events_per_s": summary([r["half_load"]["events_per_s"] for r in results]),
        "rss_mb_idle": summary([r["rss_mb_idle"] for r in results]),
        "rss_mb_16k_live": summary([r["rss_mb_16k_live"] for r in results]),
        "live_episodes": summary([r["live_episodes"] for r in results]),
        "each_run": [
            {
                "events_per_s": r["events_per_s"],
                "cpu_us_per_event": r["cpu_us_per_event"],
                "steady_cpu_us_per_event": r["steady_cpu_us_per_event"],
                "half_load_p99_ms": r["half_load"]["p99_ms"],
                "load_average": r["load_average"],
            }
            for r in results
        ],
    }


def measure(runs: int, seconds: float, serve_args: list[str], trees: dict[str, Path]) -> Any:
    """Per tree, the summaries of ``runs`` runs; the trees take turns, run by run."""
    SERVE_ARGS[:] = serve_args
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for index in range(runs):
        for label, tree in trees.items():
            figures = asyncio.run(one_run(seconds, tree))
            figures["load_average"] = os.getloadavg()[0]
            results[label].append(figures)
            print(
                f"[{label} {' '.join(serve_args) or 'defaults'}] run {index + 1}: "
                f"{figures['events_per_s']:.0f} events/s "
                f"({figures['cpu_us_per_event']:.1f} us service CPU per event, "
                f"{figures['steady_cpu_us_per_event']:.1f} at fixed work); at half load "
                f"p50 {figures['half_load']['p50_ms']:.1f} ms, "
                f"p99 {figures['half_load']['p99_ms']:.1f} ms; RSS "
                f"{figures['rss_mb_16k_live']:.0f} MB with {figures['live_episodes']:.0f} live "
                f"episodes; load average {figures['load_average']:.2f}",
                flush=True,
            )
    return {label: _summaries(found, serve_args) for label, found in results.items()}


def extract(ref: str) -> Path:
    """The ``rolloutlog`` package of git ``ref``, extracted into a temporary directory."""
    tree = Path(tempfile.mkdtemp(prefix="rolloutlog-api-bench-ref-"))
    archive = subprocess.run(
        ["git", "archive", ref, "rolloutlog"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="1 run of 2 s (smoke test)")
    parser.add_argument(
        "--workers",
        default="0,1",
        help="validation worker counts to measure, the first is the headline (default: 0,1)",
    )
    parser.add_argument(
        "--compare", default="", help="git ref whose service is measured alternately with this one"
    )
    parser.add_argument(
        "--kafka",
        action="store_true",
        help="log to Kafka (ROLLOUTLOG_BENCH_KAFKA, else a Tansu broker started here)",
    )
    parser.add_argument(
        "--synchronous",
        default="",
        help="the embedded log's synchronous setting (NORMAL: no fsync per commit group)",
    )
    parser.add_argument("--note", default="", help="context to keep with the results")
    parser.add_argument("--save-as", default="", help="result file name (default: by mode)")
    args = parser.parse_args()
    runs, seconds = (1, 2.0) if args.quick else (args.runs, args.seconds)
    SYNCHRONOUS[:] = [args.synchronous] if args.synchronous else []
    trees = {"this tree": ROOT}
    if args.compare:
        trees = {f"before ({args.compare})": extract(args.compare), "after (this tree)": ROOT}
    try:
        with kafka_broker(args.kafka) as bootstrap:
            KAFKA[:] = [bootstrap] if bootstrap else []
            configs = {
                f"validation_workers={count}": measure(
                    runs, seconds, ["--validation-workers", count.strip()], trees
                )
                for count in args.workers.split(",")
            }
    finally:
        for tree in trees.values():
            if tree != ROOT:
                shutil.rmtree(tree, ignore_errors=True)
    common = {
        "log": "kafka (Tansu)" if args.kafka else f"embedded {args.synchronous or 'FULL'}",
        "runs": runs,
        "seconds_per_phase": seconds,
        "batch": BATCH,
        "clients": CLIENTS,
        "cores": os.cpu_count(),
        "targets": TARGETS,
    }
    if args.compare:
        document = {
            **common,
            "compare": args.compare,
            "order": "alternate: each run measures every tree in turn",
            "configs": configs,
            "load_average_after": os.getloadavg()[0],
            "note": args.note,
        }
        name = "api_append_before_after" + ("_kafka" if args.kafka else "")
    else:
        configs = {config: by_tree["this tree"] for config, by_tree in configs.items()}
        headline = next(iter(configs.values()))
        document = {
            **common,
            **{key: value for key, value in headline.items() if key != "serve_args"},
            "headline": next(iter(configs)),
            "configs": configs,
            "load_average_after": os.getloadavg()[0],
            "note": args.note,
        }
        name = "api_append" + ("_kafka" if args.kafka else "")
    if not args.quick:
        path = save(args.save_as or name, document)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
