"""Log bytes of an agent loop: delta boundaries (the default) against whole-state boundaries.

One agent session runs ``--turns`` turns of a Simple-Agent-like loop (each turn a model reply and
a tool result join the messages; a boundary before each model call and after each tool round,
lazily) against the service in process (embedded log, SQLite catalog in a temporary directory),
through ``HttpTransport``. Then the agent's records are read back from the log and summed, and
compared with the summed JSON size of the loop's messages (the bar: delta boundaries within
1.5x). A checkpoint and a restore follow, and the restored state is checked to equal the loop's.
Message sizes are uniform in ``--sizes`` (bytes). Saved to ``benchmarks/results/agent_deltas.json``
(``--quick``: 50 turns, ``agent_deltas_quick.json``, not committed).

    python benchmarks/agent_deltas.py [--turns 200] [--sizes 300,1700]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import save

from rolloutlog.participants import Agent, Environment, HttpTransport, Restores
from rolloutlog.trainer import AsyncTrainerClient
from tests.api.conftest import TOKENS, Api, open_api, settings_for
from tests.participants._agent_loop import run_loop

RUN = "bench"


async def agent_bytes(api: Api) -> tuple[int, int]:
    """(bytes, records) of the agent's records in the run's log."""
    log = api.service.log
    total = count = 0
    for partition, end in enumerate(await log.end_offsets(RUN)):
        async for _, record in log.read_records(RUN, partition, 0, end):
            if b'"kind":"agent"' in record.split(b"\n", 1)[0]:
                total += len(record)
                count += 1
    return total, count


async def measure(turns: int, sizes: tuple[int, int], deltas: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data:
        async with open_api(settings_for(Path(data))) as api:
            trainer = AsyncTrainerClient(client=api.client, token=TOKENS["trainer"])
            await trainer.create_run(RUN, partitions=4)
            await trainer.take_over(RUN)
            async with HttpTransport(client=api.client, token=TOKENS["participant"]) as transport:
                env = Environment(transport, RUN, "env-0")
                agent = Agent(transport, RUN, "agent-0", deltas=deltas)
                await env.register()
                await agent.register()
                episode = await env.start_episode("e1", {"prompt": "bench"})
                await episode.boundary("seed", {"agent": "ag-1"})
                session = await agent.open_session("e1", "ag-1")
                began = time.perf_counter()
                state, message_bytes = await run_loop(session, turns, sizes)
                loop_s = time.perf_counter() - began
                log_bytes, records = await agent_bytes(api)
                began = time.perf_counter()
                await trainer.checkpoint(RUN)
                restore = await trainer.restore(RUN)
                restores = Restores(client=api.client, token=TOKENS["participant"])
                projection = await restores.fetch(RUN, "e1", restore.restore_id)
                restore_s = time.perf_counter() - began
                restored = agent.resume(projection, "ag-1")[1]
                assert restored == state, "the restored state is not the loop's"
    return {
        "deltas": deltas,
        "turns": turns,
        "message_bytes": message_bytes,
        "log_bytes": log_bytes,
        "agent_records": records,
        "ratio": round(log_bytes / message_bytes, 3),
        "state_bytes_written": session.state_bytes,
        "loop_s": round(loop_s, 3),
        "checkpoint_restore_fetch_s": round(restore_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--sizes", default="300,1700")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    low, high = (int(x) for x in args.sizes.split(","))
    turns = 50 if args.quick else args.turns
    results = {
        "sizes": [low, high],
        "cases": [asyncio.run(measure(turns, (low, high), deltas)) for deltas in (True, False)],
    }
    for case in results["cases"]:
        print(
            f"deltas={case['deltas']!s:5} turns={case['turns']} messages={case['message_bytes']} B "
            f"log={case['log_bytes']} B ratio={case['ratio']}"
        )
    print(save("agent_deltas_quick" if args.quick else "agent_deltas", results))


if __name__ == "__main__":
    main()
