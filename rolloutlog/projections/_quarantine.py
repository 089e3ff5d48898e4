"""Which log records the projector cannot take: not a rolloutlog envelope, or metadata of the wrong
shape where the fold reads it.

Anyone on the direct Kafka path can produce into a run's topic, so the projector checks what it
reads instead of trusting it. The check covers the envelope fields the tracker reads and every
metadata field of the type's ``data`` (a full pydantic validation of every record would cost the
projector most of its speed), so a record that passes cannot poison the per-episode state that
later good records are folded into (a ``seq`` that is a string, say, would make every later
comparison of that participant raise).

Most records are ones the models accept: the envelope checker (``core.check_record_meta``, the
one the append's fast path and the SDK use) says so at once, and the fold takes them. For any
other, ``_problem`` checks what the fold reads, per the models' shapes (``core.DATA_SHAPES``): the
envelope fields the tracker reads, and each metadata field of the type's ``data`` by its JSON type:
a required field must be there (None only where the model allows it); a field with a default may
be left out (the fold reads the default) but, if there, has the model's type (None only where the
model allows it). The model is the contract, so a record that breaks it is a bad record: this
quarantines a ``step.started`` without a string ``stage`` (the fold reads ``data["stage"]``), a
null ``mode``/``verify``/``constrained``/``done``, a ``parent_call_id`` left out, and a
``session.state`` whose ``checkpoint_id`` is neither an int nor null (the fold keeps it as the
export's checkpoint). The values' constraints (name patterns, digest lengths, bounds, choices)
stay the append's: a wrong value there does not make the fold raise, so ``_problem`` takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rolloutlog.core import (
    DATA_SHAPES,
    REQUIRED,
    FieldShape,
    check_record_meta,
    episode_id_problem,
)

__all__ = ["metadata_problem"]

_NUMBER = (int, float)
_MISSING: Any = object()
#: The test of each JSON type a metadata field holds.
_IS: dict[str, Callable[[Any], bool]] = {
    "str": lambda value: type(value) is str,
    "int": lambda value: type(value) is int,  # bool is an int subclass, never a seq or an offset
    "bool": lambda value: type(value) is bool,
    "number": lambda value: type(value) is int or type(value) is float,
}


def _field_check(shape: FieldShape) -> Callable[[dict[str, Any]], bool]:
    """One field's check on the data, per its model: the JSON type, None where the model allows
    it, left out where the model has a default."""
    name, test = shape.name, _IS[shape.json]
    optional, nullable = shape.default is not REQUIRED, shape.nullable

    def check(data: dict[str, Any]) -> bool:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            return optional
        if value is None:
            return nullable
        return test(value)

    return check


#: Episode ids repeat in every record of their episode: check each once.
_episode_problem = lru_cache(maxsize=1 << 16)(episode_id_problem)

#: Per event type, each metadata field's name and check: ``_problem`` names the one that fails.
_FIELD_CHECKS: dict[str, tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...]] = {
    kind: tuple((shape.name, _field_check(shape)) for shape in shapes if not shape.payload)
    for kind, shapes in DATA_SHAPES.items()
}


def _is_int(value: Any) -> bool:
    return type(value) is int


def metadata_problem(meta: Any) -> str | None:
    """Why a record's decoded metadata cannot be folded, or None when it can."""
    if check_record_meta(meta):
        return None
    return _problem(meta)


def _problem(meta: Any) -> str | None:
    """The slow path: name what is wrong."""
    if type(meta) is not dict:
        return f"the record is JSON but not an object ({type(meta).__name__})"
    kind = meta.get("type")
    if type(kind) is not str:
        return "the record has no event type" if kind is None else "its type is not a string"
    fields = _FIELD_CHECKS.get(kind)
    if fields is None:
        return f"unknown event type {kind[:64]!r}"
    data = meta.get("data")
    if type(data) is not dict:
        return f"{kind}: data is not an object"
    participant = meta.get("participant")
    if (
        type(participant) is not dict
        or type(participant.get("id")) is not str
        or not _is_int(participant.get("epoch"))
        or type(participant.get("kind")) is not str
    ):
        return f"{kind}: participant must be an object with a string id and kind, an int epoch"
    if not _is_int(meta.get("seq")) or not _is_int(meta.get("attempt")):
        return f"{kind}: seq and attempt must be integers"
    ts = meta.get("ts")
    if not isinstance(ts, _NUMBER) or isinstance(ts, bool):
        return f"{kind}: ts must be a number"
    if kind != "checkpoint.marker":
        episode = meta.get("episode")
        if type(episode) is not str:
            return f"{kind}: episode must be a string"
        problem = _episode_problem(episode)
        if problem is not None:
            return f"{kind}: episode id {episode[:64]!r} {problem}"
    for name, check in fields:
        if not check(data):
            return f"{kind}: data.{name} has the wrong type"
    return None
