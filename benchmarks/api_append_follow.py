"""The embedded log's follower at the tip, in one process: records from memory or read back.

What the append benchmark's service does with the log, without the HTTP stack and the fold:
eight appenders send batches of 100 ~250-byte records (episodes spread over 16 partitions) to
one run through ``EmbeddedLog.append_records`` while one ``follow_run`` takes every record back,
as the projector does. Timed two ways, alternately, round by round, on a fresh data directory
each: as the log runs (``tail``: a follower at the tip takes each commit group's records from
the partitions' tails in memory) and with the tails off (``read back``: every step reads the
segments just written back from SQLite and decodes them, as before). The figure is the
process's CPU time (all threads: appenders' event loop, writer threads, readers) per event,
median (min, max) over ``--rounds``; ``synchronous=NORMAL`` keeps the fsync wait out of the
wall time (not out of the CPU, which it barely uses). Results go to
``benchmarks/results/api_append_follow.json``.

    python benchmarks/api_append_follow.py [--rounds 7] [--events 40000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

from _common import save, summary

from rolloutlog.log import Record, _run_file, partition_for
from rolloutlog.log.embedded import EmbeddedLog

APPENDERS = 8
BATCH = 100
PARTITIONS = 16


async def _round(events: int) -> float:
    with tempfile.TemporaryDirectory(prefix="rolloutlog-follow-") as data_dir:
        log = EmbeddedLog(data_dir, synchronous="NORMAL")
        await log.start()
        try:
            await log.ensure_run("run", PARTITIONS)
            batches = events // BATCH // APPENDERS
            value = b"x" * 250

            async def appender(client: int) -> None:
                for b in range(batches):
                    keys = [f"r{client}-{b}-{i}" for i in range(BATCH)]
                    await log.append_records(
                        "run",
                        [Record(partition_for(k, PARTITIONS), k.encode(), value) for k in keys],
                    )

            async def follower(total: int) -> None:
                seen = 0
                pages = log.follow_run("run", [0] * PARTITIONS)
                while seen < total:
                    _, page = await anext(pages)
                    seen += len(page)
                await pages.aclose()

            started = time.process_time()
            await asyncio.gather(
                follower(batches * BATCH * APPENDERS), *(appender(c) for c in range(APPENDERS))
            )
            return (time.process_time() - started) / (batches * BATCH * APPENDERS) * 1e6
        finally:
            await log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--events", type=int, default=40_000)
    args = parser.parse_args()
    tail_bytes = _run_file._TAIL_BYTES
    times: dict[str, list[float]] = {"tail": [], "read back": []}
    asyncio.run(_round(args.events // 4))  # warm
    for _ in range(args.rounds):
        for side in times:
            _run_file._TAIL_BYTES = tail_bytes if side == "tail" else 0
            times[side].append(asyncio.run(_round(args.events)))
    figures = {side: summary(values) for side, values in times.items()}
    print(
        ", ".join(f"{side} {s['median']:.2f} us/event" for side, s in figures.items())
        + f" (load average {os.getloadavg()[0]:.2f})"
    )
    document: dict[str, Any] = {"rounds": args.rounds, "events": args.events}
    document |= {"us_per_event": figures, "load_average_after": os.getloadavg()[0]}
    print(f"saved {save('api_append_follow', document)}")


if __name__ == "__main__":
    main()
