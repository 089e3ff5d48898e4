"""The orjson codec: envelopes validated, on the wire, and rebuilt from log records.

On the wire (HTTP, SDK) an event is one JSON object, the envelope of docs/design.md §3. In the log
it is a record, whose layout ``_record`` owns (``encode_record``, ``split_record``, the peeks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from rolloutlog.core import EVENT_CLASSES, Envelope, Event, encode_opaque
from rolloutlog.errors import InvalidEvent
from rolloutlog.log._record import record_envelope

__all__ = [
    "decode_event",
    "decode_record",
    "encode_event",
    "validate_event",
    "validate_events",
]

_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def _problem_field(error: ValidationError) -> tuple[str, str]:
    first = error.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    # A discriminated union puts the event type in the location: drop it, keep the field path.
    if loc and loc[0] in EVENT_CLASSES:
        loc = loc[1:]
    return ".".join(loc) or "(envelope)", str(first["msg"])


def validate_event(value: Any, index: int | None = None) -> Event:
    """Validate one envelope (a dict, or an event already built); raise ``InvalidEvent`` naming the
    field and, in a batch, the event's index."""
    if isinstance(value, Envelope):
        return value  # type: ignore[return-value]
    try:
        return _EVENT_ADAPTER.validate_python(value)
    except ValidationError as e:
        field, reason = _problem_field(e)
        where = f"event {index}: " if index is not None else ""
        details: dict[str, Any] = {"field": field, "reason": reason}
        if index is not None:
            details["index"] = index
        raise InvalidEvent(f"{where}invalid field {field!r}: {reason}", **details) from e


def validate_events(values: Sequence[Any]) -> list[Event]:
    """Validate a batch: every envelope or none (the error names the first bad event)."""
    return [validate_event(value, index) for index, value in enumerate(values)]


def encode_event(event: Event) -> bytes:
    """The wire form: one JSON object (payloads embedded as their raw bytes)."""
    return orjson.dumps(event.model_dump(), default=encode_opaque)


def decode_event(data: bytes | str) -> Event:
    """Parse and validate one wire envelope."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent(f"not valid JSON: {e}", field="(envelope)", reason=str(e)) from e
    return validate_event(value)


def decode_record(record: bytes) -> Event:
    """Rebuild a typed event from a record the log holds (payloads stay undecoded ``Opaque``)."""
    return _EVENT_ADAPTER.validate_python(record_envelope(record))
