"""The envelope checker: one check of an envelope, built once from the event shapes.

The pydantic models of ``_events`` stay the one definition of what is accepted and the one
source of every refusal. This checker accepts a subset of what they accept, without pydantic:
an envelope as ``orjson.loads`` builds it (or as the SDK builds it, its payload already
``Opaque``) whose every field has the plain JSON type the model asks for (no coercion: an int
where a float is asked is the one exception, and pydantic turns it into that same float) and
passes the same constraint and the same rule across fields (``_shapes.DATA_RULES``). For anything
else (an unknown field, a missing one, a bool where an int is asked, a string with a control
character...) it answers None, and the caller asks the models, which accept or refuse with their
own error. Its callers:

- the append's fast path and the SDK (``check_envelope``: a client's envelope) take its answer,
  the envelope's metadata in model order with the defaults filled in and its payload's JSON, and
  have the record layout (``log/_record.py``) arrange the record's bytes;
- the projector's record check (``projections/_quarantine``, ``check_record_meta``: a record's
  metadata, the service's own events included) takes a yes as "the fold can read it", and names
  the problem itself otherwise.

The fields' converters are built from the models (``_shapes.DATA_SHAPES``: JSON type, None
allowed, default, constraint), so a field added to a model is checked without editing this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from rolloutlog.core._events import (
    EVENT_CLASSES,
    MAX_SEQ,
    SERVICE_EVENT_TYPES,
    DataRule,
    ParticipantKind,
    WriterKind,
)
from rolloutlog.core._ids import episode_id_problem, name_problem
from rolloutlog.core._opaque import Opaque
from rolloutlog.core._shapes import DATA_RULES, DATA_SHAPES, PAYLOAD_FIELD, REQUIRED, FieldShape

__all__ = ["Checked", "check_envelope", "check_record_meta", "envelope_holds"]


#: A client envelope the checker took: (metadata in model order, the payload's JSON or None,
#: episode, attempt, participant id, epoch, seq). A plain tuple: a NamedTuple's constructor
#: cost ~10% of the append's fast path.
Checked = tuple[dict[str, Any], bytes | None, str, int, str, int, int]

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


@dataclass(frozen=True, slots=True)
class _Kind:
    """What the checker tests of one event type's data, read off its shapes once."""

    #: The metadata fields in model order (the payload field is handled apart):
    #: (name, converter, default).
    fields: tuple[tuple[str, _Convert, Any], ...]
    #: The fields the data may have.
    keys: frozenset[str]
    #: The payload field, when the data carries it (a record's metadata does not).
    payload: str | None
    #: Its payload may be left out or null (``result: Opaque | None = None``): no payload then.
    optional_payload: bool
    #: Its payload is a token list, not an opaque value.
    tokens: bool
    rule: DataRule | None
    #: The type belongs to no episode (``checkpoint.marker``): its episode is None.
    no_episode: bool


#: Per event type, its metadata fields in model order: (name, converter, default).
_FIELDS: dict[str, tuple[tuple[str, _Convert, Any], ...]] = {
    kind: tuple(
        (shape.name, _converter(shape), shape.default) for shape in shapes if not shape.payload
    )
    for kind, shapes in DATA_SHAPES.items()
}


def _kind(kind: str, with_payload: bool) -> _Kind:
    shapes = DATA_SHAPES[kind]
    payloads = [shape for shape in shapes if shape.payload]
    payload = payloads[0] if payloads and with_payload else None
    return _Kind(
        fields=_FIELDS[kind],
        keys=frozenset(shape.name for shape in shapes if with_payload or not shape.payload),
        payload=None if payload is None else payload.name,
        optional_payload=payload is not None and payload.nullable and payload.default is None,
        tokens=payload is not None and payload.json == "tokens",
        # A record's metadata lacks the payload a rule may read: the rule is the append's.
        rule=DATA_RULES.get(kind) if with_payload or not payloads else None,
        no_episode=EVENT_CLASSES[kind].model_fields["episode"].annotation is type(None),
    )


#: The client event types, their data with its payload (what a writer sends).
_CLIENT: dict[str, _Kind] = {
    kind: _kind(kind, True) for kind in DATA_SHAPES if kind not in SERVICE_EVENT_TYPES
}
#: Every event type, its data without the payload (a record's metadata, ``PAYLOAD_FIELD``).
_RECORD: dict[str, _Kind] = {kind: _kind(kind, False) for kind in DATA_SHAPES}
assert all(PAYLOAD_FIELD.get(kind) == spec.payload for kind, spec in _CLIENT.items())

_WRITERS: frozenset[str] = frozenset(ParticipantKind.__args__)  # type: ignore[attr-defined]
_ALL_WRITERS: frozenset[str] = frozenset(WriterKind.__args__)  # type: ignore[attr-defined]
_ENVELOPE_KEYS = 9  # v, episode, attempt, step, participant, seq, ts, type, data


def _payload(spec: _Kind, value: Any) -> bytes | Any | None:
    """The JSON of the data's payload field: None when the record has none, ``_BAD`` when only
    pydantic may decide."""
    if spec.tokens:
        if type(value) is not list or not all(type(token) is int for token in value):
            return _BAD
    elif value is None and spec.optional_payload:
        return None
    elif type(value) is Opaque:  # the SDK's, already encoded
        return value.raw
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return _BAD  # nested deeper than orjson writes, not JSON: pydantic says why


def _data(spec: _Kind, data: Any) -> tuple[dict[str, Any], bytes | None] | None:
    """The data's metadata fields (model order, defaults in) and its payload's JSON, or None."""
    if type(data) is not dict or not data.keys() <= spec.keys:
        return None
    fields: dict[str, Any] = {}
    for name, convert, default in spec.fields:
        value = data.get(name, default)
        if value is not default:  # given (a default given as that very object is valid)
            value = convert(value)
            if value is _BAD:
                return None
        elif value is REQUIRED:
            return None
        fields[name] = value
    field = spec.payload
    payload = None
    if field is not None:
        value = data.get(field, _MISSING)
        if value is _MISSING:
            if not spec.optional_payload:
                return None
            value = None
        payload = _payload(spec, value)
        if payload is _BAD:
            return None
    rule = spec.rule
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


def _data_holds(spec: _Kind, data: Any, every: bool) -> bool:
    """Whether the data is valid as it is (no value the model would convert, an int for a
    float); ``every``: all its fields there, its payload ``Opaque`` or a token list."""
    if type(data) is not dict or not data.keys() <= spec.keys:
        return False
    if every and len(data) != len(spec.keys):
        return False
    for name, convert, default in spec.fields:
        value = data.get(name, default)
        if value is default:
            if value is REQUIRED:
                return False
        elif convert(value) is not value:
            return False
    field = spec.payload
    if field is not None:
        value = data.get(field)
        if spec.tokens:
            if type(value) is not list or not all(type(token) is int for token in value):
                return False
        elif type(value) is not Opaque and not (value is None and spec.optional_payload):
            return False
    return spec.rule is None or spec.rule(data) is None


def _envelope(value: Any, kinds: dict[str, _Kind], writers: frozenset[str], whole: bool) -> Any:
    """The spec of the envelope's type when its every field but ``data`` is valid, else None.
    ``whole``: as it is, every field there (a record's metadata, which the fold reads as is;
    an envelope the SDK built, encoded as it is), so its ``ts`` is a float already."""
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
    ts = get("ts")
    spec = kinds.get(kind) if type(kind) is str else None
    if (
        spec is None  # not a type, unknown, or (from a client) written by the service only
        or v != 1
        or type(v) is not int
        or type(attempt) is not int
        or attempt < 0
        or not (step is None or (type(step) is int and step >= 0))
        or type(seq) is not int
        or not 0 <= seq < MAX_SEQ
        or not (type(ts) is float or (not whole and _float(ts) is not _BAD))
        or type(who) is not dict
        or len(who) != 3
        or len(value)
        != (
            _ENVELOPE_KEYS
            if whole
            else _ENVELOPE_KEYS
            - ("v" not in value)
            - ("attempt" not in value)
            - ("step" not in value)
        )
    ):
        return None
    if spec.no_episode:
        if episode is not None:
            return None
    elif type(episode) is not str or not (
        episode in _EPISODES or _learn(episode, _EPISODES, episode_id_problem)
    ):
        return None
    writer = who.get("kind")
    epoch = who.get("epoch")
    if (
        _name(who.get("id")) is _BAD
        or type(writer) is not str
        or writer not in writers
        or type(epoch) is not int
        or epoch < 0
    ):
        return None
    return spec


def check_envelope(value: Any) -> Checked | None:
    """A client's envelope (a dict as parsed from JSON, or as the SDK builds it) as its record's
    metadata and payload, or None when only the models may decide (see the module docstring).
    A service event, or an envelope under the service's kind, is left to the models too."""
    spec = _envelope(value, _CLIENT, _WRITERS, False)
    if spec is None:
        return None
    data = _data(spec, value["data"])
    if data is None:
        return None
    get = value.get
    who = value["participant"]
    episode, attempt, participant, epoch = (
        value["episode"],
        get("attempt", 0),
        who["id"],
        who["epoch"],
    )
    seq = value["seq"]
    meta = {
        "v": 1,
        "episode": episode,
        "attempt": attempt,
        "step": get("step"),
        "participant": {"id": participant, "kind": who["kind"], "epoch": epoch},
        "seq": seq,
        "ts": float(value["ts"]),
        "type": value["type"],
        "data": data[0],
    }
    return meta, data[1], episode, attempt, participant, epoch, seq


def envelope_holds(event: Any) -> bool:
    """Whether a client's envelope is valid as it is, every field there (what the SDK's
    participant classes build: its record is then the envelope encoded as it is, by
    ``log.encode_record_dict``); False when only the models may decide."""
    spec = _envelope(event, _CLIENT, _WRITERS, True)
    return spec is not None and _data_holds(spec, event["data"], True)


def check_record_meta(meta: Any) -> bool:
    """Whether a record's decoded metadata (any event type, the service's included; its data
    without the payload field; every envelope field there) is one the models accept; False
    when only they may decide."""
    spec = _envelope(meta, _RECORD, _ALL_WRITERS, True)
    return spec is not None and _data_holds(spec, meta["data"], False)
