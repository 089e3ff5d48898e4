"""A restore's projection lines, built in process: what a restore + fetch costs the service
before HTTP (the part that follows the plan's commit).

S1's or S2's episodes (``workloads``) are appended straight into an embedded log (no service),
then ``replay_stream`` replays every episode at the log's end and each projection is encoded as
the restore's cache keeps it (``ProjectionLine.of``), the lines held until the end as the cache
holds them. Figures per workload: CPU seconds of this process (the log's reader threads
included) and wall seconds, each the median of ``--runs`` builds, and the process's peak RSS so
far (the workload's generation and the earlier workloads included).

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
from rolloutlog.core._model import ProjectionLine
from rolloutlog.log import open_log, partition_for
from rolloutlog.participants import KafkaTransport
from rolloutlog.projections._replay import replay_stream

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
            attempts = dict.fromkeys(names, 1)
            cpu, wall, rss = [], [], []
            for _ in range(runs):
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                lines = [
                    ProjectionLine.of(projection)
                    async for projection in replay_stream(
                        log, RUN, manifest, {}, set(), continuing_attempts=attempts
                    )
                ]
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                assert len(lines) == len(names), (len(lines), len(names))
                del lines
    return {"cpu_s": summary(cpu), "wall_s": summary(wall), "peak_rss_mb": max(rss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="S1,S2")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--save-as", default="restore_build")
    args = parser.parse_args()
    made = {"S1": workloads.s1, "S2": workloads.s2}
    results: dict[str, Any] = {}
    for name in args.workloads.split(","):
        results[name] = figures = asyncio.run(measure(made[name](), args.runs))
        print(
            f"{name}: cpu {figures['cpu_s']['median'] * 1e3:.0f} ms, wall "
            f"{figures['wall_s']['median'] * 1e3:.0f} ms, peak RSS {figures['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    print(f"saved {save(args.save_as, {'runs': args.runs, 'workloads': results})}")


if __name__ == "__main__":
    main()
