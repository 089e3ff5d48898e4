"""The embedded log's writer thread alone: its CPU per record, this tree against a git ref.

What the writer does for the append benchmark's service, without the service: commit groups of 8
appends of 100 ~250-byte records (episodes spread over 16 partitions) through
``RunFile._commit_group`` (offsets, segments, the SQLite transaction, the tails, the futures),
on one thread, timed by that thread's CPU clock. ``synchronous=NORMAL`` keeps the fsync's wait
out (it is not CPU). Each side runs in its own process (``--compare REF``: REF's ``rolloutlog``
package, extracted as ``api_append.extract`` does), alternately, round by round; the figure is
microseconds of writer-thread CPU per record, median (min, max) over ``--rounds``. Results go
to ``benchmarks/results/api_append_writer.json``.

    python benchmarks/api_append_writer.py --compare REF [--rounds 5] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import ROOT, save, summary
from api_append import extract

#: Run as ``python -c`` with the tree's package first on the path: prints the CPU per record.
_ROUND = """
import asyncio, gc, sys, tempfile, time
import orjson
from rolloutlog.log import Record, partition_for
from rolloutlog.log._run_file import Append
from rolloutlog.log.embedded import EmbeddedLog

gc.set_threshold(50_000, 50, 1_000)  # as ``serve`` sets it

async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rolloutlog-writer-") as data_dir:
        log = EmbeddedLog(data_dir, synchronous="NORMAL")
        await log.start()
        await log.ensure_run("run", 16)
        run_file = await log._run("run")
        loop = asyncio.get_running_loop()
        groups, count = [], 0
        for _ in range(300):
            group = []
            for _ in range(8):
                keys = [f"r{(count + k) % 4096}" for k in range(100)]
                records = [
                    Record(partition_for(key, 16), key.encode(), orjson.dumps({"x": "y" * 230, "n": count + k}))
                    for k, key in enumerate(keys)
                ]
                group.append(Append(records, loop, loop.create_future(), 25_000))
                count += 100
            groups.append(group)

        def commit_all() -> float:
            started = time.thread_time()
            for group in groups:
                run_file._commit_group(group)
            return (time.thread_time() - started) / count * 1e6

        print(await asyncio.to_thread(commit_all))
        await log.close()

asyncio.run(main())
"""


def _round(tree: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _ROUND], cwd=tree, env=env, capture_output=True, check=True
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", required=True, help="git ref whose writer is the before side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save-as", default="api_append_writer")
    args = parser.parse_args()
    trees = {f"before ({args.compare})": extract(args.compare), "after (this tree)": ROOT}
    times: dict[str, list[float]] = {label: [] for label in trees}
    try:
        for _ in range(args.rounds):
            for label, tree in trees.items():
                times[label].append(_round(tree))
    finally:
        for tree in trees.values():
            if tree != ROOT:
                shutil.rmtree(tree, ignore_errors=True)
    figures = {label: summary(values) for label, values in times.items()}
    print(
        ", ".join(f"{label} {s['median']:.2f} us/record" for label, s in figures.items())
        + f" (load average {os.getloadavg()[0]:.2f})"
    )
    document: dict[str, Any] = {"compare": args.compare, "rounds": args.rounds}
    document |= {"us_per_record": figures, "each_round": times}
    document["load_average_after"] = os.getloadavg()[0]
    print(f"saved {save(args.save_as, document)}")


if __name__ == "__main__":
    main()
