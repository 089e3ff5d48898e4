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

- the append's fast path (``check_envelope``: a client's envelope) takes the envelope's metadata
  in model order with the defaults filled in, and its payload's JSON, and has the record layout
  (``log/_record.py``) arrange the record's bytes;
- the SDK (``envelope_holds``: an envelope its participant classes built, every field there)
  takes a yes as "encode it as it is";
- the projector's record check (``projections/_quarantine``, ``record_holds``: a record's
  metadata, the service's own events included) asks only what the fold reads, the JSON types
  (the values' other constraints are the append's to refuse), takes a yes as "the fold can
  read it", and names the problem itself otherwise.

The fields' checks are built once from the models (``_shapes.DATA_SHAPES``: JSON type, None
allowed, default, constraint) as plain functions and tables, no generated source, so a field
added to a model is checked without editing this. A call per field is most of a field's cost:
the checks are written so that each field costs one call at most.
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
)
from rolloutlog.core._ids import episode_id_problem, name_problem
from rolloutlog.core._opaque import Opaque
from rolloutlog.core._shapes import DATA_RULES, DATA_SHAPES, PAYLOAD_FIELD, REQUIRED, FieldShape

__all__ = [
    "Checked",
    "check_envelope",
    "record_holds",
    "envelope_holds",
    "wrong_record_field",
]


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


def _str(value: Any) -> Any:
    # Printable ASCII only: the bytes orjson and pydantic-core certainly write alike.
    return value if type(value) is str and value.isascii() and value.isprintable() else _BAD


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
    # As ``_str``, inline: a call per field is most of a field's cost.
    return lambda value: (
        value
        if type(value) is str
        and low <= len(value) <= high
        and value.isascii()
        and value.isprintable()
        else _BAD
    )


def _one_of(choices: frozenset[str]) -> _Convert:
    return lambda value: value if type(value) is str and value in choices else _BAD


def _converter(shape: FieldShape) -> _Convert:
    """The converter of a metadata field: its JSON type and its model's constraint (None, where
    the model allows it, is taken before: ``_Kind.fields``)."""
    if shape.constraint == "name":
        return _name
    if shape.constraint == "digest":
        return _digest(*shape.lengths)
    if shape.constraint == "non_negative":
        return _non_negative
    if shape.constraint == "choices":
        return _one_of(shape.choices)
    return {"str": _str, "int": _int, "number": _float, "bool": _bool}[shape.json]


#: The Python types of each JSON type a record's metadata holds, as orjson decodes it.
_TYPES: dict[str, frozenset[type]] = {
    "str": frozenset({str}),
    "int": frozenset({int}),  # bool is an int subclass, never a seq or an offset
    "bool": frozenset({bool}),
    "number": frozenset({int, float}),
}
_NONE = frozenset({type(None)})
_NUMBER_TYPES = _TYPES["number"]


@dataclass(frozen=True, slots=True)
class _Kind:
    """What the checker tests of one client event type's data, read off its shapes once."""

    #: The metadata fields in model order (the payload field is handled apart):
    #: (name, converter, default, None allowed).
    fields: tuple[tuple[str, _Convert, Any, bool], ...]
    #: The fields the data may have.
    keys: frozenset[str]
    #: The payload field, if the type has one.
    payload: str | None
    #: Its payload may be left out or null (``result: Opaque | None = None``): no payload then.
    optional_payload: bool
    #: Its payload is a token list, not an opaque value.
    tokens: bool
    rule: DataRule | None


def _kind(shapes: tuple[FieldShape, ...], rule: DataRule | None) -> _Kind:
    payloads = [shape for shape in shapes if shape.payload]
    payload = payloads[0] if payloads else None
    return _Kind(
        fields=tuple(
            (shape.name, _converter(shape), shape.default, shape.nullable)
            for shape in shapes
            if not shape.payload
        ),
        keys=frozenset(shape.name for shape in shapes),
        payload=None if payload is None else payload.name,
        optional_payload=payload is not None and payload.nullable and payload.default is None,
        tokens=payload is not None and payload.json == "tokens",
        rule=rule,
    )


#: The client event types (a writer's: the service's own are the models' to check).
_CLIENT: dict[str, _Kind] = {
    kind: _kind(shapes, DATA_RULES.get(kind))
    for kind, shapes in DATA_SHAPES.items()
    if kind not in SERVICE_EVENT_TYPES
}
assert all(PAYLOAD_FIELD.get(kind) == spec.payload for kind, spec in _CLIENT.items())

#: Per event type (the service's too), the JSON types of its record's metadata fields, as the
#: fold reads them: (name, Python types, may be left out).
_RECORD_TYPES: dict[str, tuple[tuple[str, frozenset[type], bool], ...]] = {
    kind: tuple(
        (
            shape.name,
            _TYPES[shape.json] | (_NONE if shape.nullable else frozenset()),
            shape.default is not REQUIRED,
        )
        for shape in shapes
        if not shape.payload
    )
    for kind, shapes in DATA_SHAPES.items()
}
#: The types that belong to no episode (``checkpoint.marker``): their episode is None.
_NO_EPISODE = frozenset(
    kind
    for kind, cls in EVENT_CLASSES.items()
    if cls.model_fields["episode"].annotation is type(None)
)

_WRITERS: frozenset[str] = frozenset(ParticipantKind.__args__)  # type: ignore[attr-defined]
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
    for name, convert, default, nullable in spec.fields:
        value = data.get(name, default)
        if value is not default:  # given (a default given as that very object is valid)
            if value is None:
                if not nullable:
                    return None
            else:
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


def _data_holds(spec: _Kind, data: Any) -> bool:
    """Whether the data is valid as it is: every field there, none the model would convert (an
    int for a float), its payload ``Opaque`` or a token list."""
    if type(data) is not dict or len(data) != len(spec.keys):
        return False
    try:  # as many fields as the model's, each of them there: no other
        for name, convert, _, nullable in spec.fields:
            value = data[name]
            if value is None:
                if not nullable:
                    return False
            elif convert(value) is not value:
                return False
        field = spec.payload
        if field is not None:
            value = data[field]
            if spec.tokens:
                if type(value) is not list or not all(type(token) is int for token in value):
                    return False
            elif type(value) is not Opaque and not (value is None and spec.optional_payload):
                return False
    except KeyError:
        return False
    return spec.rule is None or spec.rule(data) is None


#: A client envelope's fields but ``data``, checked: (its type's spec, type, episode, attempt,
#: step, participant id, kind, epoch, seq, ts).
_Envelope = tuple[_Kind, str, str, int, "int | None", str, str, int, int, float]


def _envelope(value: Any, whole: bool) -> _Envelope | None:
    """A client envelope's every field but ``data``, when each is valid, else None. ``whole``:
    every field there, as it is (an envelope the SDK built, encoded as it is), so its ``ts`` is
    a float already."""
    if type(value) is not dict:
        return None
    try:  # the fields without a default
        kind, episode, who = value["type"], value["episode"], value["participant"]
        seq, ts = value["seq"], value["ts"]
        spec = _CLIENT[kind]  # unknown, or written by the service only: the models say so
        if whole:
            v, attempt, step = value["v"], value["attempt"], value["step"]
        else:
            get = value.get
            v, attempt, step = get("v", 1), get("attempt", 0), get("step")
        pid, writer, epoch = who["id"], who["kind"], who["epoch"]
    except (KeyError, TypeError):  # a field missing, an unhashable type, a participant of none
        return None
    if (
        v != 1
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
        or type(episode) is not str
        or not (episode in _EPISODES or _learn(episode, _EPISODES, episode_id_problem))
        or _name(pid) is _BAD
        or type(writer) is not str
        or writer not in _WRITERS
        or type(epoch) is not int
        or epoch < 0
    ):
        return None
    return spec, kind, episode, attempt, step, pid, writer, epoch, seq, ts


def check_envelope(value: Any) -> Checked | None:
    """A client's envelope (a dict as parsed from JSON, or as the SDK builds it) as its record's
    metadata and payload, or None when only the models may decide (see the module docstring).
    A service event, or an envelope under the service's kind, is left to the models too."""
    envelope = _envelope(value, False)
    if envelope is None:
        return None
    spec, kind, episode, attempt, step, participant, writer, epoch, seq, ts = envelope
    data = _data(spec, value["data"])
    if data is None:
        return None
    meta = {
        "v": 1,
        "episode": episode,
        "attempt": attempt,
        "step": step,
        "participant": {"id": participant, "kind": writer, "epoch": epoch},
        "seq": seq,
        "ts": float(ts),
        "type": kind,
        "data": data[0],
    }
    return meta, data[1], episode, attempt, participant, epoch, seq


def envelope_holds(event: Any) -> bool:
    """Whether a client's envelope is valid as it is, every field there (what the SDK's
    participant classes build: its record is then the envelope encoded as it is, by
    ``log.encode_record_dict``); False when only the models may decide."""
    envelope = _envelope(event, True)
    return envelope is not None and _data_holds(envelope[0], event["data"])


def record_holds(meta: Any) -> bool:
    """Whether the fold can read a record's decoded metadata (any event type, the service's
    included; its data without the payload field): the JSON types its models ask for, where
    the fold reads them (a field with a default may be left out: the fold reads the default),
    and an episode id that is one. False when only a closer look may tell. The values' other
    constraints (name patterns, digest lengths, bounds, choices) are the append's to refuse: a
    wrong value there does not make the fold raise."""
    try:
        kind = meta["type"]
        fields = _RECORD_TYPES[kind]
        who, data = meta["participant"], meta["data"]
        if not (
            type(who) is dict
            and type(data) is dict
            and type(meta["seq"]) is int
            and type(meta["attempt"]) is int
            and type(meta["ts"]) in _NUMBER_TYPES
            and type(who["id"]) is str
            and type(who["epoch"]) is int
            and type(who["kind"]) is str
        ):
            return False
        if kind not in _NO_EPISODE:
            episode = meta["episode"]
            if type(episode) is not str or not (
                episode in _EPISODES or _learn(episode, _EPISODES, episode_id_problem)
            ):
                return False
    except (KeyError, TypeError):  # not an object, a key missing, an unhashable type
        return False
    return _wrong_field(fields, data) is None


def _wrong_field(
    fields: tuple[tuple[str, frozenset[type], bool], ...], data: dict[str, Any]
) -> str | None:
    for name, types, optional in fields:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            if not optional:
                return name
        elif type(value) not in types:
            return name
    return None


def wrong_record_field(kind: str, data: dict[str, Any]) -> str | None:
    """The first metadata field of a record's ``data`` (its type ``kind``, a known one) that the
    fold cannot read (``record_holds``'s rule), or None."""
    return _wrong_field(_RECORD_TYPES[kind], data)
