"""The orjson codec: envelopes on the wire, and records in the log.

On the wire (HTTP, SDK) an event is one JSON object, the envelope of docs/design.md §3.

In the log a record keeps the envelope's metadata apart from its bulky payload, so that the
service folds metadata without touching payloads::

    record = metadata JSON                       (no payload field)
           | metadata JSON  b"\\n"  payload JSON  (the type's payload field, as its raw bytes)

orjson never writes a raw newline, so the first newline splits the two. The payload field is the
type's opaque field (``task``, ``state``, ``result``) or, for ledger rows and generation chunks,
``token_ids`` — which lets a restore check a row's digest on the raw bytes of its token list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from rolloutlog.errors import InvalidEvent
from rolloutlog.log._events import EVENT_CLASSES, OPAQUE_FIELD, Event, _Envelope
from rolloutlog.log._opaque import Opaque

__all__ = [
    "PAYLOAD_FIELD",
    "decode_event",
    "decode_record",
    "encode_event",
    "encode_record",
    "record_episode",
    "record_meta",
    "record_restore_id",
    "split_record",
    "validate_event",
    "validate_events",
]

_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

#: The field of each event type kept out of the record's metadata.
PAYLOAD_FIELD: dict[str, str] = {
    **OPAQUE_FIELD,
    "ledger.row": "token_ids",
    "generation.chunk": "token_ids",
}
_TOKEN_TYPES = frozenset({"ledger.row", "generation.chunk"})
#: ``model_dump_json`` exclusions that leave the payload field out of the metadata.
_EXCLUDE_PAYLOAD = {kind: {"data": {field}} for kind, field in PAYLOAD_FIELD.items()}
_SEPARATOR = b"\n"


def _default(value: Any) -> Any:
    if isinstance(value, Opaque):
        return orjson.Fragment(value.raw)
    raise TypeError(f"cannot encode {type(value).__name__}")


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
    if isinstance(value, _Envelope):
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
    return orjson.dumps(event.model_dump(), default=_default)


def decode_event(data: bytes | str) -> Event:
    """Parse and validate one wire envelope."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent(f"not valid JSON: {e}", field="(envelope)", reason=str(e)) from e
    return validate_event(value)


def encode_record(event: Event) -> bytes:
    """The log form: metadata, then (after a newline) the payload field's raw JSON."""
    exclude = _EXCLUDE_PAYLOAD.get(event.type)
    if exclude is None:
        return event.__pydantic_serializer__.to_json(event)
    head = event.__pydantic_serializer__.to_json(event, exclude=exclude)
    payload = getattr(event.data, PAYLOAD_FIELD[event.type])
    if payload is None:
        return head
    if isinstance(payload, Opaque):
        return head + _SEPARATOR + payload.raw
    return head + _SEPARATOR + orjson.dumps(payload)


def split_record(record: bytes) -> tuple[dict[str, Any], bytes | None]:
    """A record's metadata (decoded) and its payload's raw JSON (undecoded, or None)."""
    cut = record.find(_SEPARATOR)
    if cut < 0:
        return orjson.loads(record), None
    return orjson.loads(record[:cut]), record[cut + 1 :]


def record_meta(record: bytes) -> dict[str, Any]:
    """A record's metadata only: the payload after the first newline is neither decoded nor
    copied (what the projector reads of every record)."""
    cut = record.find(_SEPARATOR)
    meta: dict[str, Any] = orjson.loads(record if cut < 0 else record[:cut])
    return meta


_EPISODE_PREFIX = b'{"v":1,"episode":"'


def record_episode(record: bytes) -> str | None:
    """A record's episode, read off its first bytes where the encoder's field order allows (every
    record rolloutlog writes), else by decoding its metadata."""
    if record.startswith(_EPISODE_PREFIX):
        end = record.find(b'"', len(_EPISODE_PREFIX))
        return record[len(_EPISODE_PREFIX) : end].decode()
    episode = record_meta(record).get("episode")
    return episode if isinstance(episode, str) else None


_RESTORE_ID = b'"type":"attempt.started","data":{"restore_id":'
#: How far into a record the restore id of an ``attempt.started`` can be (its metadata comes
#: first, episode and participant names are at most 200 characters): never scan a payload.
_RESTORE_ID_WITHIN = 1024


def record_restore_id(record: bytes) -> int | None:
    """The restore id of an ``attempt.started`` record as the service encodes it (read off its
    bytes, without decoding), or None for any other record."""
    start = record.find(_RESTORE_ID, 0, _RESTORE_ID_WITHIN)
    # Only in the metadata: a JSON text escapes the quotes of any string that spells these
    # bytes, but the raw payload after the newline is not the metadata's to vouch for.
    if start < 0 or record.find(_SEPARATOR, 0, start) >= 0:
        return None
    start += len(_RESTORE_ID)
    end = record.find(b",", start, start + 24)
    digits = record[start:end] if end > 0 else b""
    return int(digits) if digits.isdigit() else None


def decode_record(record: bytes) -> Event:
    """Rebuild a typed event from a record the log holds (payloads stay undecoded ``Opaque``)."""
    meta, payload = split_record(record)
    if payload is not None:
        kind = meta["type"]
        field = PAYLOAD_FIELD[kind]
        meta["data"][field] = orjson.loads(payload) if kind in _TOKEN_TYPES else Opaque(payload)
    return _EVENT_ADAPTER.validate_python(meta)
