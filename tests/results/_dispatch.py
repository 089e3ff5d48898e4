"""A stand-in rollout collector process for the crash tests: dispatches tasks to an environment
server and waits for the replies (the test SIGKILLs it first).

    python -m tests.results._dispatch ENV_URL TASKS_JSON
"""

from __future__ import annotations

import asyncio
import sys

import httpx
import orjson


async def main(env_url: str, tasks: list[dict[str, object]]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    env_url + "/run",
                    json={"task": task, "capture_key": task["id"], "action": "fresh"},
                )
                for task in tasks
            )
        )
    for reply in replies:  # only reached when nobody killed this process
        print(reply.text, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], orjson.loads(sys.argv[2])))
