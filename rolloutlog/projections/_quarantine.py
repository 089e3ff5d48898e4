"""Which log records the projector cannot take: not a rolloutlog envelope, or metadata of the wrong
shape where the fold reads it.

Anyone on the direct Kafka path can produce into a run's topic, so the projector checks what it
reads instead of trusting it. The check covers the envelope fields the tracker reads and every
metadata field of the type's ``data`` (a full pydantic validation of every record would cost the
projector most of its speed), so a record that passes cannot poison the per-episode state that
later good records are folded into (a ``seq`` that is a string, say, would make every later
comparison of that participant raise).

The ``data`` checks are generated at import from the models (``log/_shapes.py``), one
expression per type as the hand-written ones were, and check what the model says of each field's
JSON type: a required field must be there (None only where the model allows it); a field with a
default may be left out (the fold reads the default) but, if there, has the model's type (None
only where the model allows it). The model is the contract, so a record that breaks it is a bad
record: this quarantines a ``step.started`` without a string ``stage`` (the fold reads
``data["stage"]``), a null ``mode``/``verify``/``constrained``/``done``, a ``parent_call_id`` left
out, and a ``session.state`` whose ``checkpoint_id`` is neither an int nor null (the fold keeps
it as the export's checkpoint), all of which the earlier hand-written table let through. The
values' constraints (name patterns, digest lengths, bounds, choices) stay the append's: a wrong
value there does not make the fold raise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rolloutlog.log import DATA_SHAPES, REQUIRED, FieldShape, episode_id_problem

__all__ = ["metadata_problem"]

_NUMBER = (int, float)
_NUMBER_TYPES: frozenset[type] = frozenset({int, float})
_MISSING: Any = object()
#: The test of each JSON type, on the expression ``{}``.
_IS = {
    "str": "type({}) is str",
    "int": "type({}) is int",  # bool is an int subclass, and never a seq or an offset
    "bool": "type({}) is bool",
    "number": "type({}) in _NUMBER_TYPES",
}


def _field_check(shape: FieldShape, *, raises: bool = False) -> str:
    """The source of one field's check on the data ``d``, per its model: the JSON type, None
    where the model allows it, left out where the model has a default. ``raises``: a required
    field left out raises ``KeyError`` (cheaper than ``get``, for the fast path only)."""
    name = repr(shape.name)
    if not shape.nullable and shape.default is not REQUIRED:
        return f"({name} not in d or {_IS[shape.json].format(f'd[{name}]')})"
    if raises and shape.default is REQUIRED:
        value = f"d[{name}]"
        check = _IS[shape.json].format(value)
        return check if not shape.nullable else f"({value} is None or {check})"
    check = _IS[shape.json].format(f"d.get({name})")
    if not shape.nullable:
        return check  # required: left out reads as None, which is of no JSON type here
    missing = ", _MISSING" if shape.default is REQUIRED else ""
    return f"(d.get({name}{missing}) is None or {check})"


def _compile(source: str, args: str = "d") -> Callable[..., bool]:
    """A check from its generated source (as ``dataclasses`` builds its methods)."""
    namespace = {
        "_NUMBER_TYPES": _NUMBER_TYPES,
        "_MISSING": _MISSING,
        "_episode_problem": _episode_problem,
    }
    check: Callable[..., bool] = eval(f"lambda {args}: {source}", namespace)
    return check


def _checks(shapes: tuple[FieldShape, ...]) -> tuple[str, ...]:
    return tuple(_field_check(shape, raises=True) for shape in shapes if not shape.payload)


#: Episode ids repeat in every record of their episode: check each once.
_episode_problem = lru_cache(maxsize=1 << 16)(episode_id_problem)

#: What every envelope must hold, on the metadata ``m`` (its participant ``w``, its data ``d``):
#: ``_problem`` says the same one field at a time. Missing keys raise ``KeyError``.
_ENVELOPE = (
    "type(w) is dict and type(d) is dict",
    "type(m['seq']) is int",
    "type(m['attempt']) is int",
    "type(m['ts']) in _NUMBER_TYPES",
    "type(w['id']) is str",
    "type(w['epoch']) is int",
    "type(w['kind']) is str",
)
_EPISODE = "type(m['episode']) is str and _episode_problem(m['episode']) is None"


def _accept_source(kind: str, shapes: tuple[FieldShape, ...]) -> str:
    """One type's whole check as one expression: the envelope, the episode (none on a
    ``checkpoint.marker``), then the data's fields."""
    parts = [*_ENVELOPE, *([] if kind == "checkpoint.marker" else [_EPISODE]), *_checks(shapes)]
    return " and ".join(f"({part})" for part in parts)


#: Per event type, its record check as one generated expression (the fast path: a loop over
#: the fields, or a generic envelope check before the type's, costs the projector as much as
#: decoding the record). It only accepts: anything it does not (or a missing key) goes to
#: ``_problem``, which names the problem, so the verdicts are ``_problem``'s.
_ACCEPT: dict[str, Callable[[dict[str, Any], Any, Any], bool]] = {
    kind: _compile(_accept_source(kind, shapes), "m, w, d") for kind, shapes in DATA_SHAPES.items()
}
#: Per event type, each metadata field's name and check: ``_problem`` names the one that fails.
_FIELD_CHECKS: dict[str, tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...]] = {
    kind: tuple(
        (shape.name, _compile(_field_check(shape))) for shape in shapes if not shape.payload
    )
    for kind, shapes in DATA_SHAPES.items()
}


def _is_int(value: Any) -> bool:
    return type(value) is int


def metadata_problem(meta: Any) -> str | None:
    """Why a record's decoded metadata cannot be folded, or None when it can."""
    try:
        if _ACCEPT[meta["type"]](meta, meta["participant"], meta["data"]):
            return None
    except (KeyError, TypeError):  # not an object, a key missing, an unhashable type
        pass
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
