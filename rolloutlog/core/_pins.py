"""Copies of a fold's state (``EpisodeFold.snapshot``): what a pin keeps of one moment while
records go on (a restore continues an episode from its state at the cut)."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["snapshot"]

#: The fields ``snapshot`` copies (their ``copy()``: shallow, the lineage's its own); the others
#: are immutable values, shared.
_COPIED_FIELDS = frozenset(
    (
        "lineage",
        "boundaries",
        "boundary_deltas",
        "exports",
        "sessions",
        "ledger",
        "ledger_offsets",
        "session_offsets",
        "staging_keys",
        "open_waits",
        "boundary_bytes",
        "session_bytes",
        "_pending_sessions",
        "_pending_ledger",
        "_pending_ledger_offsets",
        "_pending_staging",
        "_tail_chunks",
    )
)
_PLANS: dict[type, tuple[tuple[str, bool], ...]] = {}

#: A fold (``EpisodeFold``, or a subclass: the plan follows its slots).
F = TypeVar("F")


def snapshot(fold: F) -> F:
    """A copy of ``fold``'s state that later records do not change (the filters are shared)."""
    copy = object.__new__(type(fold))
    for name, copied in _snapshot_plan(type(fold)):
        value = getattr(fold, name)
        if copied and value is not None:
            value = value.copy()
        setattr(copy, name, value)
    copy.pinned = False  # type: ignore[attr-defined]
    copy._state_at_pin = None  # type: ignore[attr-defined]
    return copy


def _snapshot_plan(cls: type) -> tuple[tuple[str, bool], ...]:
    """Per field of ``cls`` (its subclasses' slots too), whether ``snapshot`` copies it."""
    plan = _PLANS.get(cls)
    if plan is None:
        names = [n for c in reversed(cls.__mro__) for n in getattr(c, "__slots__", ())]
        plan = tuple(
            (name, name in _COPIED_FIELDS)
            for name in names
            if name not in ("pinned", "_state_at_pin")
        )
        _PLANS[cls] = plan
    return plan
