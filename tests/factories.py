"""Builders of valid events for tests (override any field with keyword arguments)."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import orjson

from rolloutlog.log import Event, validate_event

_seq = itertools.count(1)


def participant(kind: str = "environment", pid: str = "env-0", epoch: int = 1) -> dict[str, Any]:
    return {"id": pid, "kind": kind, "epoch": epoch}


def envelope(
    type_: str,
    episode: str,
    data: dict[str, Any],
    *,
    attempt: int = 0,
    step: int | None = None,
    who: dict[str, Any] | None = None,
    seq: int | None = None,
    ts: float = 1764400000.0,
) -> dict[str, Any]:
    return {
        "v": 1,
        "type": type_,
        "episode": episode,
        "attempt": attempt,
        "step": step,
        "participant": who or participant(),
        "seq": next(_seq) if seq is None else seq,
        "ts": ts,
        "data": data,
    }


def task_digest(task: Any) -> str:
    return hashlib.sha256(orjson.dumps(task, option=orjson.OPT_SORT_KEYS)).hexdigest()


def started(episode: str, task: Any = None, **kw: Any) -> Event:
    task = {"prompt": f"task of {episode}"} if task is None else task
    data = {"task": task, "task_digest": task_digest(task), "deadline_s": 600.0}
    return validate_event(envelope("episode.started", episode, data, **kw))


def step_started(episode: str, stage: str = "seed", mode: str = "replay", **kw: Any) -> Event:
    data = {"owner": "environment", "stage": stage, "mode": mode}
    return validate_event(envelope("step.started", episode, data, **kw))


def boundary(
    episode: str, stage: str = "seed", state: Any = None, nxt: str | None = None, **kw: Any
) -> Event:
    data = {"owner": "environment", "stage": stage, "next": nxt, "state": state}
    return validate_event(envelope("step.boundary", episode, data, **kw))


def ledger_digest(parent_digest: str, token_ids: list[int]) -> str:
    text = parent_digest + ":" + ",".join(str(t) for t in token_ids)
    return hashlib.sha256(text.encode()).hexdigest()


def ledger_row(
    episode: str,
    call_id: str = "c1",
    token_ids: list[int] | None = None,
    parent: dict[str, Any] | None = None,
    policy_version: int = 1,
    **kw: Any,
) -> Event:
    tokens = list(range(512)) if token_ids is None else token_ids
    prev_len = parent["cum_len"] if parent else 0
    data = {
        "call_id": call_id,
        "parent_call_id": parent["call_id"] if parent else None,
        "fingerprint": hashlib.sha256(call_id.encode()).hexdigest(),
        "context_digest": hashlib.sha256(episode.encode()).hexdigest(),
        "policy_version": policy_version,
        "prev_len": prev_len,
        "token_ids": tokens,
        "cum_len": prev_len + len(tokens),
        "digest": ledger_digest(parent["digest"] if parent else "", tokens),
        "staging_key": f"stage-{episode}-{call_id}",
        "constrained": False,
    }
    who = kw.pop("who", participant("policy", "policy-0"))
    return validate_event(envelope("ledger.row", episode, data, who=who, **kw))


def chunk(episode: str, call_id: str = "c2", start: int = 0, n: int = 16, **kw: Any) -> Event:
    data = {
        "call_id": call_id,
        "parent_call_id": "c1",
        "request_digest": "req",
        "start": start,
        "token_ids": list(range(start, start + n)),
        "policy_version": 1,
        "staging_key": None,
    }
    who = kw.pop("who", participant("policy", "policy-0"))
    return validate_event(envelope("generation.chunk", episode, data, who=who, **kw))


def session_state(episode: str, session_id: str = "s1", state: Any = None, **kw: Any) -> Event:
    data = {"session_id": session_id, "state": {"counter": 1} if state is None else state}
    who = kw.pop("who", participant("resources", "res-0"))
    return validate_event(envelope("session.state", episode, data, who=who, **kw))


def finished(episode: str, reward: float = 1.0, result: Any = None, **kw: Any) -> Event:
    data: dict[str, Any] = {"reward": reward}
    if result is not None:
        data["result"] = result
    return validate_event(envelope("episode.finished", episode, data, **kw))


def session_started(
    episode: str,
    session_id: str = "s1",
    mode: str = "restart_only",
    verify: str = "replay",
    **kw: Any,
) -> Event:
    data = {"session_id": session_id, "mode": mode, "verify": verify}
    who = kw.pop("who", participant("resources", "res-0"))
    return validate_event(envelope("session.started", episode, data, who=who, **kw))
