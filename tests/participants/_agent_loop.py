"""An agent loop like the seed's Simple Agent (messages, step, usage), shared by the agent-deltas
benchmark and its test: each turn a model reply and a tool result join the messages."""

from __future__ import annotations

import random
from typing import Any

import orjson

from rolloutlog.participants import AgentSession


def message(role: str, size: int, rng: random.Random) -> dict[str, Any]:
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(max(1, size // 6)))
    return {"role": role, "content": words[:size]}


async def run_loop(
    session: AgentSession, turns: int, sizes: tuple[int, int], seed: int = 7
) -> tuple[dict[str, Any], int]:
    """Run ``turns`` turns (a boundary before each model call and after each tool round); return
    the final state and the summed JSON size of its messages."""
    rng = random.Random(seed)
    state: dict[str, Any] = {"step": 0, "messages": [], "usage": {"tokens": 0}, "pending": []}
    for turn in range(turns):
        await session.before_model_call(state)
        reply = message("assistant", rng.randint(*sizes), rng)
        usage = {"tokens": state["usage"]["tokens"] + len(reply["content"]) // 4}
        state = {**state, "messages": [*state["messages"], reply], "usage": usage}
        tool = message("tool", rng.randint(*sizes), rng)
        state = {**state, "messages": [*state["messages"], tool], "step": turn + 1}
        await session.after_tool_round(state)
    return state, sum(len(orjson.dumps(m)) for m in state["messages"])
