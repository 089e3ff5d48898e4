"""Helper process for the crash test: commits a large manifest and waits to be SIGKILLed.

``kill_during_commit`` runs it and kills it; as a script: ``python _commit_and_die.py URL MODE``
where MODE is ``racing`` (just commit; the parent
kills at some moment) or ``inside`` (stop right after the manifest rows are written, inside the
commit's transaction, and wait there to be killed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection

from rolloutlog.catalog import ManifestEntry, PartitionOffset, open_catalog

RUN = "crash"
ROOT = str(Path(__file__).resolve().parent.parent.parent)
PARTITIONS = 4


def entries(count: int) -> list[ManifestEntry]:
    return [
        ManifestEntry(f"e{i:06d}", 0, "continue", i % PARTITIONS, i, "seed", (f"k{i}",), 64)
        for i in range(count)
    ]


async def main(url: str, mode: str) -> None:
    catalog = open_catalog(url)
    await catalog.start()
    await catalog.create_run(RUN, partitions=PARTITIONS)
    epoch = await catalog.take_over_controller(RUN)
    offsets = [PartitionOffset(p, 100, 0) for p in range(PARTITIONS)]
    first = await catalog.begin_checkpoint(RUN, epoch)
    await catalog.commit_checkpoint(RUN, first, epoch, offsets, entries(10))
    checkpoint_id = await catalog.begin_checkpoint(RUN, epoch)
    if mode == "inside":
        backend: Any = catalog._backend  # a test-only hook into the private backend
        bulk_insert = backend.bulk_insert

        async def hooked(
            conn: AsyncConnection, table: Table, names: Sequence[str], columns: Any
        ) -> None:
            await bulk_insert(conn, table, names, columns)
            if table.name == "manifest_parts":
                print("INSIDE", flush=True)
                await asyncio.sleep(3600)

        backend.bulk_insert = hooked
    print(f"COMMITTING {checkpoint_id}", flush=True)
    await catalog.commit_checkpoint(RUN, checkpoint_id, epoch, offsets, entries(20_000))
    print("COMMITTED", flush=True)
    await asyncio.sleep(3600)


async def kill_during_commit(url: str, mode: str, delay: float) -> tuple[str, int]:
    """Run the helper until it reports ``mode``'s moment, SIGKILL it; return (state, id)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        url,
        mode,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.stdout is not None
    checkpoint_id = 0
    state = "started"
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
            assert line, "the helper exited before committing"
            if line[0] == "COMMITTING":
                checkpoint_id = int(line[1])
                if mode == "racing":
                    await asyncio.sleep(delay)
                    break
            elif line[0] in ("INSIDE", "COMMITTED"):
                state = line[0]
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        await proc.stdout.read()
    return state, checkpoint_id


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
