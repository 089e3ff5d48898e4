"""A restore's projection lines, built in process: what a restore + fetch costs the service
before HTTP (the part that follows the plan's commit).

S1's or S2's episodes (``workloads``) are appended straight into an embedded log (no service),
then every episode's projection at the log's end is built two ways and encoded as the restore's
cache keeps it (``ProjectionLine.of``), the lines held until the end as the cache holds them:
**replay** (``replay_stream``: the records read and folded again, what a restore does for the
episodes its plan could not pin) and **compose** (``compose_stream``: read back from the
positions the projector's trackers keep, what a restore of a checkpoint this service captured
does; the trackers are folded beforehand, untimed, as the projector folds them). Both give the
same lines (checked). Figures per workload and path: CPU seconds of this process (the log's
reader threads included) and wall seconds, each the median of ``--runs`` builds, and the
process's peak RSS so far (the workload's generation and the earlier workloads included).

On a shared machine wall time mostly measures the neighbours; compare CPU figures of runs
interleaved in the same window (e.g. this script from two checkouts, alternately).

    python benchmarks/restore_build.py [--workloads S1,S2] [--runs 5] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import tempfile
import time
from typing import Any

import workloads
from _common import save, summary

from rolloutlog.catalog import ManifestEntry
from rolloutlog.core import ProjectionLine, composable
from rolloutlog.log import open_log, partition_for, peek_record
from rolloutlog.participants import KafkaTransport
from rolloutlog.projections._replay import Composable, compose_stream, replay_stream
from rolloutlog.projections._tracker import EpisodeTracker

PARTITIONS = 16
RUN = "build"


async def measure(workload: workloads.Workload, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rolloutlog-build-") as directory:
        async with open_log(f"embedded://{directory}") as log:
            await log.ensure_run(RUN, PARTITIONS)
            async with KafkaTransport(log, validate=False, max_batch=4096) as transport:
                chunk: list[dict[str, Any]] = []
                for events in workload.episodes():
                    chunk.extend(events)
                    if len(chunk) >= 4000:
                        await transport.append(RUN, chunk)
                        chunk = []
                if chunk:
                    await transport.append(RUN, chunk)
            ends = await log.end_offsets(RUN)
            names = [events[0]["episode"] for events in workload.episodes()]
            manifest = [
                ManifestEntry(name, 0, "continue", p, ends[p])
                for name in names
                for p in [partition_for(name, PARTITIONS)]
            ]
            composables = await _composables(log, manifest, ends)
            assert len(composables) == len(names)
            figures: dict[str, Any] = {}
            built: dict[str, list[bytes]] = {}
            for path in ("replay", "compose"):
                cpu, wall, rss = [], [], []
                for _ in range(runs):
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    if path == "replay":
                        stream = replay_stream(log, RUN, manifest, {}, set())
                    else:
                        stream = compose_stream(log, RUN, composables, None, [])
                    lines = [ProjectionLine.of(projection) async for projection in stream]
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                    assert len(lines) == len(names), (len(lines), len(names))
                    built[path] = sorted(line.line for line in lines)
                    del lines
                figures[path] = {
                    "cpu_s": summary(cpu),
                    "wall_s": summary(wall),
                    "peak_rss_mb": max(rss),
                }
            assert built["replay"] == built["compose"]
    return figures


async def _composables(
    log: Any, manifest: list[ManifestEntry], ends: list[int]
) -> list[Composable]:
    """Every episode's tracker folded as the projector folds it, ready to compose."""
    trackers: dict[str, EpisodeTracker] = {}
    for entry in manifest:
        trackers.setdefault(entry.episode, EpisodeTracker(entry.episode, entry.cut_partition))
    for partition in range(PARTITIONS):
        async for page in log.read_pages(RUN, partition, 0, ends[partition]):
            for offset, record in page:
                meta, start = peek_record(record)
                trackers[meta["episode"]].observe(offset, meta, record, start)
    out = []
    for entry in manifest:
        tracker = trackers[entry.episode]
        assert composable(tracker)
        out.append(Composable.of(entry, tracker))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="S1,S2")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--save-as", default="restore_build")
    args = parser.parse_args()
    made = {"S1": workloads.s1, "S2": workloads.s2}
    results: dict[str, Any] = {}
    for name in args.workloads.split(","):
        results[name] = paths = asyncio.run(measure(made[name](), args.runs))
        for path, figures in paths.items():
            print(
                f"{name} {path}: cpu {figures['cpu_s']['median'] * 1e3:.0f} ms, wall "
                f"{figures['wall_s']['median'] * 1e3:.0f} ms, peak RSS "
                f"{figures['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    print(f"saved {save(args.save_as, {'runs': args.runs, 'workloads': results})}")


if __name__ == "__main__":
    main()
