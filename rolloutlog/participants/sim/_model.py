"""The simulated workload: tasks, deterministic tokens and the reward each task must get.

Everything here is a pure function, so a test (or the collector) can compute what any episode's
model calls and reward must be without running it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "RESOURCES_KINDS",
    "answer_of",
    "expected_answer",
    "expected_reward",
    "make_task",
    "make_tasks",
    "reply_text",
    "request_digest",
    "sim_tokens",
]

#: The resources servers a task can use (one process each): ``counter`` (exported: its state must
#: be restored), ``verifier`` (stateless) and ``restart`` (restart-only: restarts its episodes).
RESOURCES_KINDS: tuple[str, ...] = ("counter", "verifier", "restart", "sandbox")
_VOCAB = 50_000


def make_task(
    episode: str,
    *,
    resources: str = "counter",
    rounds: int = 2,
    tokens: int = 48,
    constrained: Sequence[int] = (),
    verify_delay_s: float = 0.0,
    token_rate: float | None = None,
) -> dict[str, Any]:
    """A task: ``rounds`` tool rounds (so ``rounds + 1`` model calls of ``tokens`` tokens each;
    the calls whose index is in ``constrained`` use constrained decoding), against the named
    resources server; ``verify_delay_s`` makes verify slow; ``token_rate`` overrides the policy's
    tokens per second for this task's calls."""
    if resources not in RESOURCES_KINDS:
        raise ValueError(f"unknown resources kind {resources!r}")
    if rounds < 0 or tokens < 1:
        raise ValueError("rounds must be >= 0 and tokens >= 1")
    task: dict[str, Any] = {
        "id": episode,
        "resources": resources,
        "rounds": rounds,
        "tokens": tokens,
        "constrained": sorted(set(constrained)),
        "verify_delay_s": verify_delay_s,
    }
    if token_rate is not None:
        task["token_rate"] = token_rate
    return task


def make_tasks(
    count: int,
    *,
    prefix: str = "r",
    kinds: Sequence[str] = RESOURCES_KINDS,
    rounds: int = 2,
    tokens: int = 48,
    constrained_every: int = 0,
    long_every: int = 0,
    long_tokens: int = 96,
    long_token_rate: float | None = None,
) -> list[dict[str, Any]]:
    """``count`` tasks ``r0``, ``r1``, … cycling over ``kinds``; with ``constrained_every=k``,
    every k-th task's first call is constrained; with ``long_every=k``, every k-th task's calls
    generate ``long_tokens`` tokens (long calls: generation chunks) instead of ``tokens``, at
    ``long_token_rate`` tokens/s when given."""
    tasks = []
    for i in range(count):
        long = bool(long_every) and i % long_every == 1
        tasks.append(
            make_task(
                f"{prefix}{i}",
                resources=kinds[i % len(kinds)],
                rounds=rounds,
                tokens=long_tokens if long else tokens,
                constrained=(0,) if constrained_every and i % constrained_every == 0 else (),
                token_rate=long_token_rate if long else None,
            )
        )
    return tasks


def _seed(*parts: object) -> int:
    text = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def sim_tokens(episode: str, call_index: int, count: int) -> list[int]:
    """The tokens call ``call_index`` of ``episode`` generates: token i depends only on the
    episode, the call index and i (so a regenerated or continued call yields the same ones)."""
    base = _seed(episode, call_index)
    return [(base + i * 2_654_435_761) % _VOCAB for i in range(count)]


def request_digest(episode: str, call_index: int, tokens: int, constrained: bool) -> str:
    """The digest of a model request (the same for every attempt of the episode)."""
    return hashlib.sha256(f"{episode}:{call_index}:{tokens}:{constrained}".encode()).hexdigest()


def context_digest(turns: Sequence[str]) -> str:
    return hashlib.sha256(orjson.dumps(list(turns))).hexdigest()


def reply_text(call_index: int, token_ids: Sequence[int]) -> str:
    """The model-authored turn a call's tokens decode to."""
    digest = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]
    return f"c{call_index}:{digest}"


def answer_of(turns: Sequence[str]) -> str:
    """The agent's final answer: a digest of every model-authored turn."""
    return hashlib.sha256("|".join(turns).encode()).hexdigest()[:16]


def expected_turns(task: Mapping[str, Any]) -> list[str]:
    episode, tokens = str(task["id"]), int(task["tokens"])
    return [reply_text(n, sim_tokens(episode, n, tokens)) for n in range(int(task["rounds"]) + 1)]


def expected_answer(task: Mapping[str, Any]) -> str:
    """The answer an episode of ``task`` must end with."""
    return answer_of(expected_turns(task))


def verdict(
    task: Mapping[str, Any], response: Mapping[str, Any], counter: int | None
) -> dict[str, Any]:
    """A tool server's verify reply for ``response`` to ``task``: reward 1.0 when the answer is
    ``expected_answer`` and the session's ``counter`` (None: a stateless server keeps none)
    reached the task's rounds, else 0.0 (``expected_reward``)."""
    answer_ok = response.get("answer") == expected_answer(task)
    right = answer_ok and (counter is None or counter == int(task["rounds"]))
    result: dict[str, Any] = {"reward": 1.0 if right else 0.0, "answer_ok": answer_ok}
    if counter is not None:
        result["counter"] = counter
    return result


def expected_reward(task: Mapping[str, Any]) -> float:
    """The reward a correctly run (or correctly restored) episode of ``task`` gets: 1.0. A wrong
    answer, or a counter that missed increments (state not restored), gets 0.0."""
    return 1.0
