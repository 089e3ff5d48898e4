"""Benchmark: a checkpoint's two catalog transactions on the embedded (SQLite) catalog while the
event loop is busy (as under S4), through aiosqlite (one event-loop hop per statement) and in
one hop (``SQLiteBackend.write_in_one_hop``), alternating in one process.

The busy loop stands in for S4's saturating HTTP appends: ``--hogs`` tasks each hold the loop
for ``--hold-ms`` of CPU, then yield (an append request of 100 events takes ~3 ms of the
service's loop), then sleeps ``--idle-ms`` (the loop is not always full). Each round: ``begin_checkpoint``, then ``commit_checkpoint`` of a delta
manifest of ``--changed`` entries over a whole one of ``--entries`` (a live checkpoint).
Prints and saves ``benchmarks/results/checkpoint_busy_loop.json`` (``--save-as`` to rename).

Usage: ``python benchmarks/checkpoint_busy_loop.py [--rounds N] [--hogs N] [--hold-ms MS]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import save, summary

from rolloutlog.catalog import ManifestEntry, PartitionOffset, open_catalog

PARTITIONS = 16


def entries(count: int, cut: int) -> list[ManifestEntry]:
    return [
        ManifestEntry(f"e{i:06d}", 0, "continue", i % PARTITIONS, cut, "invoke_agent", (), 1000)
        for i in range(count)
    ]


async def hog(hold_s: float, idle_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        until = time.perf_counter() + hold_s
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(idle_s)


async def measure(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {
        mode: {"begin_ms": [], "commit_ms": []} for mode in ("per_statement", "one_hop")
    }
    async with open_catalog(f"sqlite+aiosqlite:///{directory / 'catalog.db'}") as catalog:
        backend: Any = catalog._backend
        await catalog.create_run("bench", partitions=PARTITIONS)
        epoch = await catalog.take_over_controller("bench")
        cut = 1000

        def offsets() -> list[PartitionOffset]:
            return [PartitionOffset(p, cut + p, 0) for p in range(PARTITIONS)]

        checkpoint_id = await catalog.begin_checkpoint("bench", epoch)
        whole = entries(args.entries, cut)
        await catalog.commit_checkpoint("bench", checkpoint_id, epoch, offsets(), whole)
        base = checkpoint_id
        stop = asyncio.Event()
        hogs = [
            asyncio.create_task(hog(args.hold_ms / 1000, args.idle_ms / 1000, stop))
            for _ in range(args.hogs)
        ]
        try:
            for index in range(2 * args.rounds):
                mode = ("per_statement", "one_hop")[index % 2]
                backend.one_hop_writes = mode == "one_hop"
                cut += 100
                changed = [e._replace(cut_offset=cut) for e in whole[: args.changed]]
                t0 = time.perf_counter()
                checkpoint_id = await catalog.begin_checkpoint("bench", epoch)
                t1 = time.perf_counter()
                await catalog.commit_checkpoint(
                    "bench",
                    checkpoint_id,
                    epoch,
                    offsets(),
                    changed,
                    base_checkpoint_id=base,
                    totals={
                        "continue": args.entries,
                        "restart": 0,
                        "finished": 0,
                        "size_bytes": 1000 * args.entries,
                    },
                )
                t2 = time.perf_counter()
                base = checkpoint_id
                times[mode]["begin_ms"].append((t1 - t0) * 1000)
                times[mode]["commit_ms"].append((t2 - t1) * 1000)
        finally:
            stop.set()
            await asyncio.gather(*hogs)
            backend.one_hop_writes = True
    return {
        mode: {name: summary(values) for name, values in figures.items()}
        for mode, figures in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="per mode")
    parser.add_argument("--hogs", type=int, default=4)
    parser.add_argument("--hold-ms", type=float, default=3.0)
    parser.add_argument("--idle-ms", type=float, default=2.0, help="each hog's sleep between")
    parser.add_argument("--entries", type=int, default=16_000)
    parser.add_argument("--changed", type=int, default=200)
    parser.add_argument("--save-as", default="checkpoint_busy_loop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rolloutlog-busy-") as directory:
        results = asyncio.run(measure(args, Path(directory)))
    for mode, figures in results.items():
        print(
            f"{mode:14s} "
            + "  ".join(
                f"{name} {f['median']:.1f} ms ({f['min']:.1f}-{f['max']:.1f})"
                for name, f in figures.items()
            )
        )
    results["parameters"] = vars(args)
    print(save(args.save_as, results))


if __name__ == "__main__":
    main()
