"""Subprocess for the SIGKILL test: append batches forever, print each batch id once acknowledged."""

from __future__ import annotations

import asyncio
import sys

from rolloutlog.log import open_log
from tests import factories as f

BATCH = 7


async def main(data_dir: str, state_bytes: int) -> None:
    async with open_log(data_dir) as log:
        await log.ensure_run("run", 4)

        async def appender(worker: int) -> None:
            batch = 0
            while True:
                batch_id = worker * 1_000_000 + batch
                events = [
                    f.boundary(f"w{worker}-{i % 3}", state="x" * state_bytes, seq=batch_id * 10 + i)
                    for i in range(BATCH)
                ]
                await log.append("run", events)
                sys.stdout.write(f"{batch_id}\n")
                sys.stdout.flush()
                batch += 1

        await asyncio.gather(*(appender(w) for w in range(8)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2000))
