"""The shape of each event type's ``data``, derived at import from the pydantic models of ``_events``.

``DATA_SHAPES`` (each field's JSON type, constraint, default), ``DATA_RULES`` (each model's rule
across fields) and the payload field of each type (``PAYLOAD_FIELD``: the one ``Opaque`` or
token-list field, which a record keeps apart from its metadata; ``OPAQUE_FIELD``: the ``Opaque``
ones) are read off the models, so no table repeats them by hand.

The models are the one definition of what an event's data holds. The envelope checker
(``_check``: the append's fast path, the SDK's check, the projector's record check) builds its
tables from ``DATA_SHAPES`` instead of writing the fields again, so a field added to a model is
checked by all three without editing them. A field of a kind this module does not know (another
constraint, another type) raises at import: someone must say how the fast paths check it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic.fields import FieldInfo

from rolloutlog.core._events import EVENT_CLASSES, DataRule
from rolloutlog.core._ids import NAME_PATTERN
from rolloutlog.core._opaque import Opaque

__all__ = [
    "DATA_RULES",
    "DATA_SHAPES",
    "OPAQUE_FIELD",
    "PAYLOAD_FIELD",
    "REQUIRED",
    "FieldShape",
]


#: The default of a required field.
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()

JsonType = Literal["str", "int", "number", "bool", "opaque", "tokens"]
Constraint = Literal["name", "digest", "non_negative", "choices", "plain"]


@dataclass(frozen=True, slots=True)
class FieldShape:
    """One field of an event type's data, as its model declares it."""

    name: str
    #: The JSON value it holds: ``number`` takes an int or a float; ``opaque`` and ``tokens``
    #: (a list of ints) are the record's payload, kept out of its metadata.
    json: JsonType
    nullable: bool
    #: ``REQUIRED`` when the model has no default.
    default: Any
    constraint: Constraint
    #: The allowed strings (``choices``), else empty.
    choices: frozenset[str] = frozenset()
    #: A digest's (min, max) length, else (0, 0).
    lengths: tuple[int, int] = (0, 0)

    @property
    def payload(self) -> bool:
        return self.json in ("opaque", "tokens")


_BASES: dict[Any, JsonType] = {str: "str", int: "int", float: "number", bool: "bool"}


def _unwrap(info: FieldInfo) -> tuple[Any, list[Any], bool]:
    """The field's base annotation, its constraints and whether None is allowed."""
    annotation, metadata = info.annotation, list(info.metadata)
    args = typing.get_args(annotation)
    nullable = (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    )
    if nullable:
        (annotation,) = [arg for arg in args if arg is not type(None)]
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            for item in extra:
                metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return annotation, metadata, nullable


def _bounds(item: Any) -> dict[str, Any]:
    """A constraint as keyword and value: ``Ge(ge=0)`` -> {"ge": 0}."""
    if dataclasses.is_dataclass(item):  # annotated_types' Ge, MinLen, MaxLen...
        return {field.name: getattr(item, field.name) for field in dataclasses.fields(item)}
    return {key: value for key, value in vars(item).items() if value is not None}


def _shape(kind: str, name: str, info: FieldInfo) -> FieldShape:
    base, metadata, nullable = _unwrap(info)
    default = REQUIRED if info.is_required() else info.default
    where = f"{kind} data.{name}"
    if base is Opaque or base == list[int]:
        if metadata:
            raise TypeError(f"{where}: a constrained payload field")
        json: JsonType = "opaque" if base is Opaque else "tokens"
        return FieldShape(name, json, nullable, default, "plain")
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if metadata or not all(type(choice) is str for choice in choices):
            raise TypeError(f"{where}: only plain string Literals are derived")
        return FieldShape(name, "str", nullable, default, "choices", frozenset(choices))
    json = _BASES.get(base)  # type: ignore[assignment]
    if json is None:
        raise TypeError(f"{where}: no shape for {base!r}")
    bounds = {key: value for item in metadata for key, value in _bounds(item).items()}
    if not bounds:
        return FieldShape(name, json, nullable, default, "plain")
    if json == "str" and bounds == {"pattern": NAME_PATTERN}:
        return FieldShape(name, json, nullable, default, "name")
    if json == "str" and bounds.keys() == {"min_length", "max_length"}:
        lengths = (bounds["min_length"], bounds["max_length"])
        return FieldShape(name, json, nullable, default, "digest", lengths=lengths)
    if json == "int" and bounds == {"ge": 0}:
        return FieldShape(name, json, nullable, default, "non_negative")
    raise TypeError(f"{where}: no shape for the constraints {bounds}")


def _data_model(kind: str) -> Any:
    model = EVENT_CLASSES[kind].model_fields["data"].annotation
    assert isinstance(model, type)
    return model


#: Per event type (client and service), its data's fields in model order.
DATA_SHAPES: dict[str, tuple[FieldShape, ...]] = {
    kind: tuple(_shape(kind, name, info) for name, info in _data_model(kind).model_fields.items())
    for kind in EVENT_CLASSES
}

#: Per event type that has one, its data model's rule across fields (``_events._Data.rule``).
DATA_RULES: dict[str, DataRule] = {
    kind: rule for kind in EVENT_CLASSES if (rule := _data_model(kind).rule) is not None
}


def _payload_fields(json: JsonType | None) -> dict[str, str]:
    """Per event type, its payload field (of that JSON type; any with None); a type with two
    payload fields raises: a record has room for one."""
    fields: dict[str, str] = {}
    for kind, shapes in DATA_SHAPES.items():
        payloads = [shape for shape in shapes if shape.payload]
        if len(payloads) > 1:
            raise TypeError(f"{kind}: more than one payload field")
        if payloads and json in (None, payloads[0].json):
            fields[kind] = payloads[0].name
    return fields


#: The field of each event type kept out of its record's metadata (the record layout, ``_record``).
PAYLOAD_FIELD: dict[str, str] = _payload_fields(None)
#: The one opaque field of each event type that has one.
OPAQUE_FIELD: dict[str, str] = _payload_fields("opaque")
