"""The append's fast path: an envelope checked and turned into its record without pydantic.

The pydantic models of ``_events`` stay the one definition of what is accepted and the one
source of every refusal. ``fast_record`` accepts a subset of what they accept: a client's
envelope, as ``orjson.loads`` builds it, whose every field has the plain JSON type the model
asks for (no coercion: an int where a float is asked is the one exception, and pydantic turns
it into that same float) and passes the same constraint. For such an envelope it returns what
``encode_record(validate_event(value))`` returns, byte for byte; for anything else (a service
event, an unknown field, a missing one, a bool where an int is asked, a string with a control
character...) it returns None and the caller validates with pydantic, which accepts it or
refuses it with its own error. ``tests/log/test_fastpath.py`` checks the two agree, envelope by
envelope, on generated valid and invalid envelopes of every type.

The record's bytes are the model's JSON: its fields in model order, defaults filled in, the
payload field (``_shapes.PAYLOAD_FIELD``) after a newline; orjson writes strings, ints and
floats as pydantic-core does (floats in the shortest round-trip form, tested).

The data fields' converters are built from the models (``_shapes.DATA_SHAPES``: JSON type,
None allowed, default, constraint), so a field added to a model is taken without editing this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from rolloutlog.core import (
    DATA_RULES,
    DATA_SHAPES,
    MAX_SEQ,
    PAYLOAD_FIELD,
    REQUIRED,
    SERVICE_EVENT_TYPES,
    FieldShape,
    episode_id_problem,
    name_problem,
)

__all__ = ["FastRecord", "fast_record"]


#: An envelope's record and what fencing reads of it: (record, episode, attempt, participant
#: id, epoch, seq). A plain tuple: a NamedTuple's constructor cost ~10% of the fast path.
FastRecord = tuple[bytes, str, int, str, int, int]


_MISSING: Any = object()
#: What a converter returns for a value the model may refuse.
_BAD: Any = object()
#: Ints a float field takes as the same float (pydantic converts them; tested up to here).
_MAX_FLOAT_INT = 2**53
_Convert = Callable[[Any], Any]


#: Names and episode ids already checked (they repeat from event to event); emptied when full
#: (at most 16,384 strings each: under 5 MB each even with 200-character ids).
_NAMES: set[str] = set()
_EPISODES: set[str] = set()
_KNOWN_MAX = 1 << 14


def _learn(value: str, known: set[str], problem: Callable[[str], str | None]) -> bool:
    """Whether ``value`` (not in ``known``) passes ``problem``'s check; remembered if so."""
    if problem(value) is not None:
        return False
    if len(known) >= _KNOWN_MAX:
        known.clear()
    known.add(value)
    return True


def _name(value: Any) -> Any:
    if type(value) is str and (value in _NAMES or _learn(value, _NAMES, name_problem)):
        return value
    return _BAD


def _non_negative(value: Any) -> Any:
    # Bools are ints to Python, not to strict pydantic.
    return value if type(value) is int and value >= 0 else _BAD


def _plain(value: Any) -> bool:
    # Printable ASCII only: the bytes orjson and pydantic-core certainly write alike.
    return type(value) is str and value.isascii() and value.isprintable()


def _str(value: Any) -> Any:
    return value if _plain(value) else _BAD


def _int(value: Any) -> Any:
    return value if type(value) is int else _BAD


def _bool(value: Any) -> Any:
    return value if type(value) is bool else _BAD


def _float(value: Any) -> Any:
    """A float field's value as strict pydantic makes it: a float, or an int as that float."""
    if type(value) is float:
        return value
    if type(value) is int and -_MAX_FLOAT_INT <= value <= _MAX_FLOAT_INT:
        return float(value)
    return _BAD


def _digest(low: int, high: int) -> _Convert:
    return lambda value: value if _plain(value) and low <= len(value) <= high else _BAD


def _one_of(choices: frozenset[str]) -> _Convert:
    return lambda value: value if type(value) is str and value in choices else _BAD


def _or_none(convert: _Convert) -> _Convert:
    return lambda value: value if value is None else convert(value)


def _converter(shape: FieldShape) -> _Convert:
    """The converter of a metadata field: its JSON type and its model's constraint."""
    if shape.constraint == "name":
        convert: _Convert = _name
    elif shape.constraint == "digest":
        convert = _digest(*shape.lengths)
    elif shape.constraint == "non_negative":
        convert = _non_negative
    elif shape.constraint == "choices":
        convert = _one_of(shape.choices)
    else:
        convert = {"str": _str, "int": _int, "number": _float, "bool": _bool}[shape.json]
    return _or_none(convert) if shape.nullable else convert


#: The metadata fields of each client event type's data, in model order (the payload field,
#: which the metadata leaves out, is handled apart): (name, converter, default), derived from
#: the models (``_shapes``).
_Fields = tuple[tuple[str, _Convert, Any], ...]
_DATA: dict[str, _Fields] = {
    kind: tuple(
        (shape.name, _converter(shape), shape.default) for shape in shapes if not shape.payload
    )
    for kind, shapes in DATA_SHAPES.items()
    if kind not in SERVICE_EVENT_TYPES
}
#: The types whose payload field may be left out or null (``result: Opaque | None = None``):
#: then its record has no payload.
_OPTIONAL_PAYLOAD = frozenset(
    kind
    for kind, shapes in DATA_SHAPES.items()
    for shape in shapes
    if shape.payload and shape.nullable and shape.default is None
)
_TOKENS = frozenset(
    kind for kind, shapes in DATA_SHAPES.items() for shape in shapes if shape.json == "tokens"
)
#: Every writer kind but the service's (its events are refused by the caller, after pydantic).
_WRITER_KINDS = frozenset({"environment", "policy", "agent", "resources"})
_ENVELOPE_KEYS = 9  # v, episode, attempt, step, participant, seq, ts, type, data


#: The fields each client type's data may have.
_KEYS: dict[str, frozenset[str]] = {
    kind: frozenset(shape.name for shape in DATA_SHAPES[kind]) for kind in _DATA
}


def _payload(kind: str, value: Any) -> bytes | Any | None:
    """The JSON of the data's payload field: None when the record has none, ``_BAD`` when only
    pydantic may decide."""
    if kind in _TOKENS:
        if type(value) is not list or not all(type(token) is int for token in value):
            return _BAD
    elif value is None and kind in _OPTIONAL_PAYLOAD:
        return None
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return _BAD  # nested deeper than orjson writes: pydantic says why


def _data(kind: str, data: Any) -> tuple[dict[str, Any], bytes | None] | None:
    """The data's metadata fields (model order, defaults in) and its payload's JSON, or None."""
    if type(data) is not dict or not data.keys() <= _KEYS[kind]:
        return None
    fields: dict[str, Any] = {}
    for name, convert, default in _DATA[kind]:
        value = data.get(name, default)
        if value is not default:  # given (a default given as that very object is valid)
            value = convert(value)
            if value is _BAD:
                return None
        elif value is REQUIRED:
            return None
        fields[name] = value
    field = PAYLOAD_FIELD.get(kind)
    payload = None
    if field is not None:
        value = data.get(field, _MISSING)
        if value is _MISSING:
            if kind not in _OPTIONAL_PAYLOAD:
                return None
            value = None
        payload = _payload(kind, value)
        if payload is _BAD:
            return None
    rule = DATA_RULES.get(kind)
    if rule is not None:
        if field is None:
            problem = rule(fields)
        else:  # the rule reads the payload field beside the others, without a copy of them
            fields[field] = value
            problem = rule(fields)
            del fields[field]
        if problem is not None:
            return None
    return fields, payload


def fast_record(value: Any) -> FastRecord | None:
    """The record of a client envelope (a dict as parsed from JSON), or None when only pydantic
    may decide (see the module docstring)."""
    if type(value) is not dict:
        return None
    get = value.get
    kind = get("type")
    v = get("v", 1)
    episode = get("episode")
    attempt = get("attempt", 0)
    step = get("step")
    who = get("participant")
    seq = get("seq")
    ts = _float(get("ts", _BAD))
    if (
        type(kind) is not str
        or kind not in _DATA  # unknown, or written by the service only
        or v != 1
        or type(v) is not int
        or type(episode) is not str
        or type(attempt) is not int
        or attempt < 0
        or not (step is None or (type(step) is int and step >= 0))
        or type(seq) is not int
        or not 0 <= seq < MAX_SEQ
        or ts is _BAD
        or type(who) is not dict
        or len(who) != 3
        or len(value)
        != _ENVELOPE_KEYS - ("v" not in value) - ("attempt" not in value) - ("step" not in value)
        or not (episode in _EPISODES or _learn(episode, _EPISODES, episode_id_problem))
    ):
        return None
    pid = _name(who.get("id"))
    writer = who.get("kind")
    epoch = who.get("epoch")
    if (
        pid is _BAD
        or type(writer) is not str
        or writer not in _WRITER_KINDS
        or type(epoch) is not int
        or epoch < 0
    ):
        return None
    data = _data(kind, get("data"))
    if data is None:
        return None
    fields, payload = data
    head = orjson.dumps(
        {
            "v": 1,
            "episode": episode,
            "attempt": attempt,
            "step": step,
            "participant": {"id": pid, "kind": writer, "epoch": epoch},
            "seq": seq,
            "ts": ts,
            "type": kind,
            "data": fields,
        }
    )
    record = head if payload is None else b"%b\n%b" % (head, payload)
    return record, episode, attempt, pid, epoch, seq
