"""The crash suite's side of the simulated Gym (``rolloutlog.participants.sim``): a Gym on a
deployment, dispatching one episode to the environment server, and reading what each
participant process did (its ``/sim/stats``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import httpx

from rolloutlog.participants.sim import Gym
from tests.e2e._harness import Deployment

#: Fast enough to keep episodes short, slow enough that a hold is reached mid-generation.
TOKEN_RATE = 4000.0
CHUNK_TOKENS = 16


def gym_for(deployment: Deployment, **knobs: Any) -> Gym:
    return Gym(
        deployment.data_dir / "gym",
        log_url=deployment.log_url,
        catalog_url=deployment.catalog_url,
        participant_transport=deployment.transport,
        token_rate=TOKEN_RATE,
        chunk_tokens=CHUNK_TOKENS,
        **knobs,
    )


class EpisodeFailed(AssertionError):
    def __init__(self, key: str, status: int, body: str) -> None:
        super().__init__(f"{key}: the environment answered {status}: {body[:500]}")
        self.status = status


class Episodes:
    """Episodes dispatched to the Gym's environment server, one request each (as a collector
    does): ``start`` returns at once, ``reply`` awaits the result."""

    def __init__(self, gym: Gym) -> None:
        self.gym = gym
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0))
        self.running: dict[str, asyncio.Task[dict[str, Any]]] = {}

    def start(
        self,
        task: dict[str, Any],
        capture_key: str | None = None,
        action: str = "fresh",
        restore_id: int | None = None,
    ) -> str:
        key = capture_key or str(task["id"])
        body = {"task": task, "capture_key": key, "action": action, "restore_id": restore_id}
        self.running[key] = asyncio.create_task(self._post(body))
        return key

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(self.gym.url("environment") + "/run", json=body)
        if response.status_code != 200:
            raise EpisodeFailed(body["capture_key"], response.status_code, response.text)
        result: dict[str, Any] = response.json()
        return result

    async def held(self, name: str, point: str, key: str) -> dict[str, Any]:
        """``Gym.wait_held`` for an episode dispatched here; an episode whose request ends
        before it parks fails at once, with the environment's answer."""
        episode = self.running[key]
        waiting = asyncio.ensure_future(self.gym.wait_held(name, point, key))
        try:
            await asyncio.wait({waiting, episode}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
        if waiting.done() and not waiting.cancelled():
            return waiting.result()
        self.running.pop(key)
        reply = episode.result()  # its EpisodeFailed, if it failed
        raise AssertionError(f"{key}: the episode ended before {name} parked at {point}: {reply}")

    async def reply(self, key: str) -> dict[str, Any]:
        return await self.running.pop(key)

    async def cut_off(self, keys: Iterable[str]) -> None:
        """The requests of episodes whose participants were killed: each failed mid-flight."""
        for key in keys:
            try:
                await self.running.pop(key)
            except httpx.TransportError:
                continue  # the environment process died with the request
            except EpisodeFailed as e:
                # The processes die one group after another: the environment may still answer
                # (an error) once a process it called is gone.
                assert e.status >= 500, e
                continue
            raise AssertionError(f"{key}: the episode finished although it was cut off")

    async def close(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        await self.client.aclose()


def calls_of(policy_stats: dict[str, Any], key: str) -> list[tuple[str, str | None, int, int]]:
    """The model calls the policy served for one capture key: (call id, parent call id, tokens
    continued from a cut, tokens generated)."""
    return [
        (c["call_id"], c["parent_call_id"], c["continued"], c["generated"])
        for c in policy_stats["calls"]
        if c["capture_key"] == key
    ]


def runs_of(stats: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return [r for r in stats["runs"] if r["capture_key"] == key]
