"""What a user would pick instead of rolloutlog, measured on the same envelopes.

- **stop-the-world export**: the seed's design reduced to its core. Admission pauses, every live
  episode parks at its next boundary (modelled as asyncio tasks that park at once: the real wait
  for the longest in-flight step, 2 s in the seed's policy stage, is *not* counted, so the
  figure is a lower bound), every participant serializes its live state (JSON, as the seed did) to
  a record file named by its digest and fsyncs it (participants export concurrently), the
  manifest is written and fsynced last, then the episodes resume. Its restore reads the manifest
  and the record files and decodes them.
- **pyeventsourcing** (``eventsourcing``, SQLite persistence): one aggregate per episode, one
  aggregate event per envelope, a snapshot of every episode at its latest version; reconstruction = ``repository.get`` of every
  live episode (what a restore must hand out).
- **floor**: reading the records a restore replays from rolloutlog's own log and splitting them
  (metadata decoded, opaque payloads passed through, as the service does) with nothing else.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from _common import summary
from workloads import Workload, live_states

from rolloutlog.log import Log, peek_record

# -- stop-the-world export --------------------------------------------------------------------


def _write_record_file(
    directory: Path, participant: str, states: Mapping[str, Any]
) -> dict[str, Any]:
    body = b"\n".join(orjson.dumps({"episode": e, "state": s}) for e, s in states.items())
    digest = hashlib.sha256(body).hexdigest()
    path = directory / f"{digest}.jsonl"
    with open(path, "wb") as out:
        out.write(body)
        out.flush()
        os.fsync(out.fileno())
    return {
        "participant": participant,
        "file": path.name,
        "episodes": len(states),
        "bytes": len(body),
    }


def _make_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)


def _write_manifest(directory: Path, entries: list[dict[str, Any]]) -> None:
    """The manifest, last: written, fsynced, then the directory entry fsynced."""
    with open(directory / "MANIFEST.json", "wb") as out:
        out.write(orjson.dumps({"checkpoint": uuid.uuid4().hex, "records": entries}))
        out.flush()
        os.fsync(out.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def stop_the_world_checkpoint(
    states: Mapping[str, Mapping[str, Any]], directory: Path
) -> dict[str, float]:
    """Pause, park every live episode, export every participant's state, manifest last, resume."""
    episodes = sorted({e for per in states.values() for e in per})
    loop = asyncio.get_running_loop()
    pause = asyncio.Event()
    resume = asyncio.Event()
    parked = [loop.create_future() for _ in episodes]

    async def episode(index: int) -> None:
        await pause.wait()  # the step in flight ends at the next boundary (counted as 0 s)
        parked[index].set_result(None)
        await resume.wait()

    tasks = [asyncio.create_task(episode(i)) for i in range(len(episodes))]
    await asyncio.sleep(0)
    _make_dir(directory)
    t0 = time.perf_counter()
    pause.set()
    await asyncio.gather(*parked)
    t_parked = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(16, len(states) or 1)) as pool:
        entries = await asyncio.gather(
            *(
                loop.run_in_executor(pool, _write_record_file, directory, pid, per)
                for pid, per in states.items()
            )
        )
    _write_manifest(directory, entries)
    t_exported = time.perf_counter()
    resume.set()
    await asyncio.gather(*tasks)
    t_resumed = time.perf_counter()
    return {
        "checkpoint_s": t_resumed - t0,
        "park_s": t_parked - t0,
        "export_s": t_exported - t_parked,
        "resume_s": t_resumed - t_exported,
        "bytes": float(sum(e["bytes"] for e in entries)),
    }


def stop_the_world_restore(directory: Path) -> tuple[float, int]:
    """Read the manifest and every record file, decode every state; (seconds, episodes)."""
    t0 = time.perf_counter()
    manifest = orjson.loads((directory / "MANIFEST.json").read_bytes())
    restored: dict[str, dict[str, Any]] = {}
    for entry in manifest["records"]:
        per = restored.setdefault(entry["participant"], {})
        for line in (directory / entry["file"]).read_bytes().split(b"\n"):
            if not line:
                continue
            item = orjson.loads(line)
            per[item["episode"]] = item["state"]
    episodes = len({e for per in restored.values() for e in per})
    return time.perf_counter() - t0, episodes


# -- pyeventsourcing --------------------------------------------------------------------------


@functools.cache
def _eventsourcing() -> tuple[Any, Any]:
    """pyeventsourcing's aggregate and application classes (defined once: the library registers
    each class by its topic). Imported here so that the rest of this module needs no extra."""
    from eventsourcing.application import Application
    from eventsourcing.domain import Aggregate, event

    class Rollout(Aggregate):
        """One episode: the same fold as the projection's committed state."""

        @staticmethod
        def create_id(episode: str) -> uuid.UUID:
            return uuid.uuid5(uuid.NAMESPACE_URL, "rollout/" + episode)

        @event("Started")
        def __init__(self, episode: str, task: dict[str, Any]) -> None:
            self.episode = episode
            self.task = task
            self.boundaries: dict[str, Any] = {}
            self.sessions: dict[str, Any] = {}
            self.ledger: list[Any] = []
            self.generation: Any = None
            self.finished = False

        @event("Recorded")
        def record(self, type_: str, data: dict[str, Any]) -> None:
            if type_ == "step.boundary":
                self.boundaries[data["owner"]] = data
            elif type_ == "session.started":
                self.sessions.setdefault(data["session_id"], None)
            elif type_ == "session.state":
                self.sessions[data["session_id"]] = data["state"]
            elif type_ == "ledger.row":
                self.ledger.append(data)
            elif type_ == "generation.chunk":
                self.generation = data
            elif type_ == "episode.finished":
                self.finished = True

    class Rollouts(Application):
        is_snapshotting_enabled = True

    return Rollout, Rollouts


def _eventsourcing_app(db_path: Path) -> Any:
    _, rollouts = _eventsourcing()
    return rollouts(
        env={"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(db_path)}
    )


def _save_with_snapshots(app: Any, aggregates: list[Any]) -> None:
    """Save the aggregates' events in one transaction, then a snapshot of each at its latest
    version in one more (the library's own ``take_snapshot`` commits each snapshot alone: most
    of the setup time; the reconstruction reads the same rows either way)."""
    from eventsourcing.domain import Snapshot

    app.save(*aggregates)
    app.snapshots.put([Snapshot.take(aggregate) for aggregate in aggregates])


def eventsourcing_store(
    db_path: Path, episodes: Iterable[list[dict[str, Any]]]
) -> tuple[float, list[str]]:
    """Store every episode's envelopes as aggregate events (with snapshots); (seconds, live ids)."""
    app = _eventsourcing_app(db_path)
    rollout_class, _ = _eventsourcing()
    live: list[str] = []
    t0 = time.perf_counter()
    batch = []
    for events in episodes:
        first = events[0]
        aggregate = rollout_class(first["episode"], first["data"]["task"])
        for envelope in events[1:]:
            aggregate.record(envelope["type"], envelope["data"])
        if not aggregate.finished:
            live.append(first["episode"])
        batch.append(aggregate)
        if len(batch) >= 256:
            _save_with_snapshots(app, batch)
            batch = []
    if batch:
        _save_with_snapshots(app, batch)
    elapsed = time.perf_counter() - t0
    app.close()
    return elapsed, live


def eventsourcing_reconstruct(db_path: Path, live: list[str]) -> float:
    """Reconstruct every live episode from its latest snapshot and later events (a fresh app)."""
    app = _eventsourcing_app(db_path)
    rollout_class, _ = _eventsourcing()
    t0 = time.perf_counter()
    for episode in live:
        aggregate = app.repository.get(rollout_class.create_id(episode))
        assert aggregate.task is not None
    elapsed = time.perf_counter() - t0
    app.close()
    return elapsed


# -- the floor --------------------------------------------------------------------------------


async def floor(log: Log, run: str, offsets: Iterable[Mapping[str, Any]]) -> tuple[float, int]:
    """Read the records a restore of this checkpoint replays as its composition reads them
    (``read_pages_in_place``: the embedded log's large records as views of their blob files)
    and split each into its decoded metadata and where its payload starts (``peek_record``),
    the payload passed through uncopied; (seconds, bytes)."""
    t0 = time.perf_counter()
    total = 0

    async def one(partition: int, start: int, end: int) -> None:
        nonlocal total
        async for page in log.read_pages_in_place(run, partition, start, end):
            for _, record in page:
                peek_record(record)
                total += len(record)

    await asyncio.gather(
        *(one(o["partition"], o.get("replay_from") or 0, o["marker"]) for o in offsets)
    )
    return time.perf_counter() - t0, total


def socket_floor(size: int) -> float:
    """The least a fetch of ``size`` bytes over a socket can take: that many bytes sent through a
    loopback TCP connection from one thread to another, received into one reused buffer and not
    looked at (no HTTP, no splitting into lines, no decoding, no plan); seconds from the
    connect to the end of the stream."""
    payload = memoryview(bytearray(b"\x01") * max(1, size))
    with socket.create_server(("127.0.0.1", 0)) as server:

        def send() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

        sender = threading.Thread(target=send)
        sender.start()
        buffer = memoryview(bytearray(1 << 20))
        t0 = time.perf_counter()
        with socket.create_connection(server.getsockname()) as conn:
            while conn.recv_into(buffer):
                pass
        elapsed = time.perf_counter() - t0
        sender.join()
    return elapsed


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
