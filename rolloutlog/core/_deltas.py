"""Delta states of agent boundaries: what changed since the owner's previous boundary.

A ``step.boundary`` whose state is the JSON object ``{"$delta": {"set": {...}, "append": {...},
"unset": [...]}}`` (encoded by orjson, so its bytes begin with ``DELTA_PREFIX``) does not replace
its owner's state: the fold composes it onto the owner's previous state (``compose_state``) — keys set,
lists extended, keys removed — so an agent's log grows with the new messages of each turn instead
of the whole history (docs/design.md, "Agent deltas"). Any other state replaces the previous one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

__all__ = ["DELTA_KEY", "DELTA_PREFIX", "compose_state", "state_delta", "is_delta"]

DELTA_KEY = "$delta"
DELTA_PREFIX = b'{"$delta":'


def is_delta(record: bytes | memoryview, start: int = 0) -> bool:
    """Whether the payload at ``record[start:]`` is a delta state (a prefix test, no decoding)."""
    if type(record) is bytes:
        return record.startswith(DELTA_PREFIX, start)
    return record[start : start + len(DELTA_PREFIX)] == DELTA_PREFIX


def state_delta(previous: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """What changed from ``previous`` to ``state`` (both JSON objects): the keys set, the lists
    that only grew (their new items), the keys gone; ``{}`` when nothing changed. Items a list
    already had are compared, never re-sent: they must not change in place."""
    changed: dict[str, Any] = {}
    appended: dict[str, Any] = {}
    for key, value in state.items():
        old = previous.get(key, _MISSING)
        if old is value:
            continue
        if (
            type(value) is list
            and type(old) is list
            and len(value) >= len(old)
            and value[: len(old)] == old
        ):
            if len(value) > len(old):
                appended[key] = value[len(old) :]
            continue
        if old != value:
            changed[key] = value
    gone = [key for key in previous if key not in state]
    delta: dict[str, Any] = {}
    if changed:
        delta["set"] = changed
    if appended:
        delta["append"] = appended
    if gone:
        delta["unset"] = gone
    return delta


def compose_state(base: bytes | memoryview | None, deltas: Iterable[bytes | memoryview]) -> bytes:
    """The state that ``deltas`` (delta payloads, in log order) make of ``base`` (an owner's
    last whole state; None for an empty object)."""
    state = orjson.loads(base) if base is not None else {}
    if not isinstance(state, dict):
        raise ValueError("a delta state composes onto a JSON object only")
    for raw in deltas:
        delta = orjson.loads(raw)[DELTA_KEY]
        state.update(delta.get("set") or {})
        for key, items in (delta.get("append") or {}).items():
            current = state.get(key)
            state[key] = [*current, *items] if isinstance(current, list) else list(items)
        for key in delta.get("unset") or ():
            state.pop(key, None)
    return orjson.dumps(state)


_MISSING = object()
